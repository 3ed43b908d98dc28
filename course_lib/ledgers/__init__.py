"""The ledgers: what each rank did, measured — bytes per collective (``comm``), the timeline and program
(``trace``), bytes held by category (``memory``)."""
