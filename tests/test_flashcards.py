"""The flashcard deck is complete and points at real lessons; the widget, the printable pages and the Anki file
show every card as they should."""

import csv
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from course_lib.practice.flashcards import (
    ANKI_HEADER,
    DECK_PATH,
    FIELDS,
    Card,
    deck_widget,
    export_anki,
    export_printable,
    load_deck,
)

ROOT = Path(__file__).resolve().parent.parent
# The nine topics of the practice page, each by the tag of the card (also tagged "practice") that covers it.
PRACTICE_TOPICS = {
    "data parallelism and its limit": "data-parallelism",
    "tensor parallelism and its interconnect": "tensor-parallelism",
    "pipeline parallelism and its cost": "pipeline-parallelism",
    "what FSDP / ZeRO shards": "zero-fsdp",
    "where TP and PP go": "placement",
    "3D parallelism": "3d-parallelism",
    "when FSDP rather than TP or PP": "fsdp-vs-tp-pp",
    "16 bytes per parameter, made actionable": "memory-accounting",
    "pipeline bubbles and their fix": "pipeline-bubble",
}
TRICKY = Card("tricky", "Is <b>a</b> < b && \"c\" > 'd'?", "<script>alert('x')</script> & done", ("a", "b"), "x")


def make_cards(n: int) -> list[Card]:
    """``n`` cards whose question and answer say their number."""
    return [Card(f"c{i}", f"question {i}?", f"answer {i} <ok>", ("t",), "notebooks/x.ipynb") for i in range(n)]


def shown(widget) -> str:
    """The question the widget shows, as plain text."""
    return html.unescape(re.sub(r"<[^>]+>", "", widget.question.value))


# The deck


def test_the_deck_file_has_every_field_and_unique_slug_ids():
    entries = json.loads(DECK_PATH.read_text(encoding="utf-8"))
    assert DECK_PATH == ROOT / "flashcards" / "deck.json" and len(entries) >= 20
    for entry in entries:
        assert set(entry) == set(FIELDS), entry.get("id")
        assert all(isinstance(entry[f], str) and entry[f].strip() for f in FIELDS if f != "tags"), entry["id"]
        assert entry["tags"] and all(re.fullmatch(r"[a-z0-9-]+", tag) for tag in entry["tags"]), entry["id"]
    ids = [entry["id"] for entry in entries]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"[a-z0-9-]+", i) for i in ids)
    assert [card.id for card in load_deck()] == ids


def test_the_nine_practice_topics_are_covered():
    practice_tags = {tag for card in load_deck() if "practice" in card.tags for tag in card.tags}
    missing = [topic for topic, tag in PRACTICE_TOPICS.items() if tag not in practice_tags]
    assert not missing


def test_every_lesson_is_a_notebook_of_the_course():
    for card in load_deck():
        assert card.lesson.startswith("notebooks/") and card.lesson.endswith(".ipynb"), card.id
        assert (ROOT / card.lesson).is_file(), card.id


def test_loading_says_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no flashcard deck"):
        load_deck(tmp_path / "missing.json")
    deck = tmp_path / "deck.json"
    deck.write_text(json.dumps([{"id": "half", "question": "q?", "tags": []}]))
    with pytest.raises(ValueError, match="card half .* lacks: answer, lesson"):
        load_deck(deck)


# The printable pages


class PageParser(HTMLParser):
    """Collects each ``div.page``: its style and the text of its ``meta`` and ``text`` paragraphs."""

    def __init__(self) -> None:
        super().__init__()
        self.pages: list[dict[str, str]] = []
        self._paragraph: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "div" and attributes.get("class") == "page":
            self.pages.append({"style": attributes.get("style") or "", "meta": "", "text": ""})
        elif tag == "p" and self.pages:
            self._paragraph = attributes.get("class")

    def handle_endtag(self, tag: str) -> None:
        if tag == "p":
            self._paragraph = None

    def handle_data(self, data: str) -> None:
        if self._paragraph:
            self.pages[-1][self._paragraph] += data


def test_printable_has_a_question_page_then_an_answer_page_per_card(tmp_path):
    cards = [*load_deck(), TRICKY]
    path = export_printable(tmp_path / "cards.html", cards)
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    assert len(parser.pages) == 2 * len(cards)
    for k, card in enumerate(cards):
        question, answer = parser.pages[2 * k], parser.pages[2 * k + 1]
        assert question["text"] == card.question and answer["text"] == card.answer
        assert question["meta"] == f"card {k + 1} of {len(cards)} · question · {' '.join(card.tags)}"
        assert answer["meta"] == f"card {k + 1} of {len(cards)} · answer · {' '.join(card.tags)}"
    for page in parser.pages:
        assert "page-break-after: always" in page["style"] and "break-after: page" in page["style"]


def test_printable_escapes_the_cards_text(tmp_path):
    text = export_printable(tmp_path / "cards.html", [TRICKY]).read_text(encoding="utf-8")
    assert "<script>" not in text and "<b>a</b>" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; done" in text
    assert "<link" not in text and "src=" not in text  # self-contained


def test_printable_defaults_to_the_course_deck(tmp_path):
    text = export_printable(tmp_path / "cards.html").read_text(encoding="utf-8")
    assert text.count('<div class="page"') == 2 * len(load_deck())


# The widget


def test_flip_shows_the_answer_and_next_hides_it():
    widget = deck_widget(make_cards(3))
    assert shown(widget) == "question 0?" and widget.answer.value == ""
    widget.buttons["Flip"].click()
    assert "answer 0 &lt;ok&gt;" in widget.answer.value
    widget.buttons["Next"].click()
    assert shown(widget) == "question 1?" and widget.answer.value == ""


def test_next_advances_and_wraps_round():
    widget = deck_widget(make_cards(3))
    seen = []
    for _ in range(4):
        seen.append(shown(widget))
        widget.buttons["Next"].click()
    assert seen == ["question 0?", "question 1?", "question 2?", "question 0?"]
    assert widget.progress.value == "card 2 of 3, 0 known"


def test_known_cards_are_skipped():
    widget = deck_widget(make_cards(4))
    widget.buttons["I know this"].click()
    assert shown(widget) == "question 1?" and widget.progress.value == "card 2 of 4, 1 known"
    seen = []
    for _ in range(4):
        widget.buttons["Next"].click()
        seen.append(shown(widget))
    assert seen == ["question 2?", "question 3?", "question 1?", "question 2?"]
    for _ in range(3):
        widget.buttons["I know this"].click()
    assert widget.progress.value.endswith("4 known")
    widget.buttons["Next"].click()  # nothing left to show: it stays
    assert widget.progress.value.endswith("4 known")


def test_shuffle_is_deterministic_for_a_seed():
    def order_after_shuffle(seed: int) -> list[str]:
        widget = deck_widget(make_cards(8), seed=seed)
        widget.buttons["Shuffle"].click()
        order = []
        for _ in range(8):
            order.append(shown(widget))
            widget.buttons["Next"].click()
        return order

    first = order_after_shuffle(0)
    assert first == order_after_shuffle(0)
    assert first != [f"question {i}?" for i in range(8)] and sorted(first) == sorted(order_after_shuffle(1))
    assert first != order_after_shuffle(1)


def test_shuffle_starts_on_a_card_not_yet_known():
    widget = deck_widget(make_cards(5), seed=3)
    for _ in range(4):
        widget.buttons["I know this"].click()
    widget.buttons["Flip"].click()
    widget.buttons["Shuffle"].click()
    assert shown(widget) == "question 4?" and widget.answer.value == ""
    assert widget.progress.value.endswith(", 4 known")


def test_the_widget_defaults_to_the_course_deck():
    assert deck_widget().progress.value == f"card 1 of {len(load_deck())}, 0 known"


# The Anki file


def test_anki_file_has_its_header_and_one_row_per_card(tmp_path):
    cards = load_deck()
    lines = export_anki(tmp_path / "cards.txt").read_text(encoding="utf-8").splitlines()
    assert tuple(lines[:3]) == ANKI_HEADER == ("#separator:tab", "#html:false", "#tags column:3")
    rows = lines[3:]
    assert len(rows) == len(cards) and all(len(row.split("\t")) == 3 for row in rows)
    assert [row.split("\t") for row in rows] == [[c.question, c.answer, " ".join(c.tags)] for c in cards]


def test_anki_quotes_what_would_break_a_row(tmp_path):
    odd = Card("odd", 'a "quoted"\tfront', "two\nlines", ("x", "y"), "x")
    path = export_anki(tmp_path / "cards.txt", [odd, TRICKY])
    with path.open(encoding="utf-8", newline="") as file:
        rows = list(csv.reader(file.readlines()[3:], delimiter="\t"))
    assert rows == [[c.question, c.answer, " ".join(c.tags)] for c in (odd, TRICKY)]
