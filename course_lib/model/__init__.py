"""The model every scheme trains: its configs and vocabularies (``config``), the tiny GPT and the one-device
reference (``gpt``), mixed precision, recomputation, and the formulas that predict its parameters and memory."""
