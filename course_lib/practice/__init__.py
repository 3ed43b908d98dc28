"""Practice: graded exercises and estimates, bug hunts, flashcards, write-it-yourself and its checks."""
