"""Real ranks: the rank server (``forkserver``), the rank processes (``ranks``), ``launch``, distributed notebook
cells (``cells``), injected faults (``faults``) and distributed checkpoints (``checkpoint``)."""
