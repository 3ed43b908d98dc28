"""The course's flashcards: load the deck (``flashcards/deck.json``), drill it in a notebook, print it, or export it
for Anki.

Each card is a question, its answer, tags (single words, no spaces) and the lesson that teaches it.
"""

from __future__ import annotations

import csv
import html
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ipywidgets as widgets

DECK_PATH = Path(__file__).resolve().parents[2] / "flashcards" / "deck.json"
FIELDS = ("id", "question", "answer", "tags", "lesson")
PAGE_BREAK = "page-break-after: always; break-after: page"
ANKI_HEADER = ("#separator:tab", "#html:false", "#tags column:3")
PRINT_CSS = """
@page { margin: 2cm; }
body { font-family: Georgia, "Times New Roman", serif; margin: 0; }
.page { padding: 1.5em 0; }
.meta { font-size: 10pt; color: #555; }
.text { font-size: 22pt; line-height: 1.4; }
@media screen { .page { border-bottom: 1px dashed #aaa; margin: 0 2em; } }
"""


@dataclass(frozen=True)
class Card:
    """One flashcard."""

    id: str
    question: str
    answer: str
    tags: tuple[str, ...]
    lesson: str


def load_deck(path: str | Path | None = None) -> list[Card]:
    """The cards of a deck file (default: the course's ``flashcards/deck.json``), in file order.

    Raises FileNotFoundError if there is no such file, ValueError if a card lacks one of :data:`FIELDS`.
    """
    path = DECK_PATH if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no flashcard deck at {path}")
    entries = json.loads(path.read_text(encoding="utf-8"))
    return [_card(entry, index, path) for index, entry in enumerate(entries)]


def _card(entry: dict, index: int, path: Path) -> Card:
    """A card from its JSON object, the ``index``-th of the deck at ``path``."""
    missing = [field for field in FIELDS if field not in entry]
    if missing:
        raise ValueError(f"card {entry.get('id', f'#{index}')} in {path} lacks: {', '.join(missing)}")
    return Card(entry["id"], entry["question"], entry["answer"], tuple(entry["tags"]), entry["lesson"])


def _or_deck(cards: list[Card] | None) -> list[Card]:
    """The given cards, or the course's deck if none are given."""
    return load_deck() if cards is None else cards


class DeckState:
    """Where a drill stands: the order of the cards, the current one, which are known, whether the answer shows.

    Plain Python, so that the widget's logic can be driven without a browser.
    """

    def __init__(self, cards: list[Card], seed: int = 0) -> None:
        if not cards:
            raise ValueError("the deck has no cards")
        self.cards = cards
        self.order = list(range(len(cards)))
        self.position = 0
        self.known: set[int] = set()
        self.flipped = False
        self._rng = random.Random(seed)

    @property
    def card(self) -> Card:
        """The card shown now."""
        return self.cards[self.order[self.position]]

    @property
    def progress(self) -> str:
        """For example ``card 3 of 20, 5 known``."""
        return f"card {self.position + 1} of {len(self.cards)}, {len(self.known)} known"

    def flip(self) -> None:
        """Show the answer, or hide it again."""
        self.flipped = not self.flipped

    def next(self) -> None:
        """Go to the next card not yet known, wrapping round; stay where we are if every other card is known."""
        for step in range(1, len(self.order) + 1):
            candidate = (self.position + step) % len(self.order)
            if self.order[candidate] not in self.known:
                self.position = candidate
                break
        self.flipped = False

    def know(self) -> None:
        """Mark the current card as known (it is skipped from now on) and go to the next one."""
        self.known.add(self.order[self.position])
        self.next()

    def shuffle(self) -> None:
        """Put the cards in a new random order (the same sequence of orders for the same seed) and start again from
        the first card not yet known."""
        self._rng.shuffle(self.order)
        unknown = (i for i, index in enumerate(self.order) if index not in self.known)
        self.position = next(unknown, 0)
        self.flipped = False


class DeckWidget(widgets.VBox):
    """A drill in the notebook: the question, the answer once flipped, the buttons and a progress label.

    ``buttons`` maps each button's description (Flip, Next, Shuffle, I know this) to the button.
    """

    def __init__(self, cards: list[Card], seed: int = 0) -> None:
        super().__init__()
        self.state = DeckState(cards, seed)
        self.question = widgets.HTML()
        self.answer = widgets.HTML()
        self.details = widgets.HTML()
        self.progress = widgets.Label()
        actions = {
            "Flip": self.state.flip,
            "Next": self.state.next,
            "Shuffle": self.state.shuffle,
            "I know this": self.state.know,
        }
        self.buttons = {name: self._button(name, action) for name, action in actions.items()}
        self.children = [
            self.question,
            self.answer,
            self.details,
            widgets.HBox(list(self.buttons.values())),
            self.progress,
        ]
        self._render()

    def _button(self, description: str, action: Callable[[], None]) -> widgets.Button:
        """A button that applies ``action`` to the state, then redraws."""
        button = widgets.Button(description=description)

        def on_click(_: widgets.Button) -> None:
            action()
            self._render()

        button.on_click(on_click)
        return button

    def _render(self) -> None:
        """Show the state: the current card, its answer if flipped, the progress."""
        card = self.state.card
        self.question.value = f"<p style='font-size: 1.3em'><b>{html.escape(card.question)}</b></p>"
        self.answer.value = f"<p style='font-size: 1.1em'>{html.escape(card.answer)}</p>" if self.state.flipped else ""
        self.details.value = f"<small>{html.escape(' '.join(card.tags))} · {html.escape(card.lesson)}</small>"
        self.progress.value = self.state.progress


def deck_widget(cards: list[Card] | None = None, seed: int = 0) -> DeckWidget:
    """Drill the cards (default: the course's deck) one at a time; ``seed`` fixes the Shuffle button's orders."""
    return DeckWidget(_or_deck(cards), seed)


def _page(number: int, total: int, side: str, text: str, tags: tuple[str, ...]) -> str:
    """One printed page: the card number, side and tags in small print, then the text in large type."""
    meta = f"card {number} of {total} · {side} · {' '.join(tags)}"
    return (
        f'<div class="page" style="{PAGE_BREAK}">\n'
        f'<p class="meta">{html.escape(meta)}</p>\n'
        f'<p class="text">{html.escape(text)}</p>\n'
        "</div>\n"
    )


def export_printable(path: str | Path, cards: list[Card] | None = None) -> Path:
    """Write the cards (default: the course's deck) as one self-contained HTML file to print: each card's question
    on a page of its own, its answer on the next page. Printed double-sided, each answer lands on the back of its
    question."""
    cards = _or_deck(cards)
    pages = "".join(
        _page(number, len(cards), side, text, card.tags)
        for number, card in enumerate(cards, start=1)
        for side, text in (("question", card.question), ("answer", card.answer))
    )
    document = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>Flashcards: training across many devices</title>\n<style>{PRINT_CSS}</style>\n</head>\n"
        f"<body>\n{pages}</body>\n</html>\n"
    )
    path = Path(path)
    path.write_text(document, encoding="utf-8")
    return path


def export_anki(path: str | Path, cards: list[Card] | None = None) -> Path:
    """Write the cards (default: the course's deck) as a tab-separated file for Anki's File > Import: front, back,
    and the tags separated by spaces, under the header lines that tell Anki so."""
    path = Path(path)
    with path.open("w", encoding="utf-8", newline="") as file:
        file.write("\n".join(ANKI_HEADER) + "\n")
        writer = csv.writer(file, delimiter="\t", lineterminator="\n")
        writer.writerows((card.question, card.answer, " ".join(card.tags)) for card in _or_deck(cards))
    return path
