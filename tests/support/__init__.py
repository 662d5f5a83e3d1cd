"""What the three tiers share: fixtures (``fixtures``), throwaway databases (``database``) and
servers (``servers``), making and checking batches (``batches``), stand-in and real engines
(``engines``, ``smollm2``), scheduler doubles (``scheduler``), billing helpers (``billing``),
process trees (``processes``) and the check that a run leaves the checkout alone
(``tree_check``)."""
