"""Control: how people and producers steer runs from outside. Signals (approve, reject, input,
cancel, extend: :mod:`.signals`), the run API over HTTP (:mod:`.run_api`) with its stream caps
(:mod:`.streams`), ambient triggers from events (:mod:`.triggers`), the debug bundle and its
``EXPLAIN.md`` (:mod:`.debug_bundle`, :mod:`.explain`) and the metrics (:mod:`.metrics`). Imports
the record and planning wings only."""
