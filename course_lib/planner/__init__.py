"""The planner: model x cluster -> a layout (TP x CP x PP x DP x EP, ZeRO, schedule) with memory, step time and the
reasons for it; published runs beside its estimates; goodput under failures."""
