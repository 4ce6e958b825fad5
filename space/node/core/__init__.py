"""What every part of the node agent shares: the node's configuration (``config``), a
sandbox's persisted state (``state``), the live sandbox and its VM (``sandbox``), a
template as the node sees it (``template``), request checks (``validation``), the
bounded subprocess helper (``run``) and the token bucket per-second budgets use
(``token_bucket``)."""
