"""What every part of the node agent shares: the node's configuration (``config``), a
sandbox's persisted state (``state``), the live sandbox and its VM (``sandbox``), a
template as the node sees it (``template``), request checks (``validation``) and the
bounded subprocess helper (``run``)."""
