"""The categories of model state, measured by the memory ledger (:mod:`course_lib.ledgers.memory`) and predicted by
the formulas (:mod:`course_lib.model.formulas`); here, apart from the ledger, so that the formulas, the planner and
the command line import no torch."""

CATEGORIES = ("params", "grads", "optimizer")  # the unique storages of the parameters, their .grad, optimizer state
