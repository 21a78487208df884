"""The run record: what the coordinator knows of every run, durably. Runs and their event logs
(:mod:`.runs`), the operations ledger (:mod:`.operations`), the checkpoints (:mod:`.checkpoints`),
who may reach a run (:mod:`.access`), the work queue that hands runs to workers (:mod:`.work`), the
approval requests of a parked run (:mod:`.gates`) and the one ``LISTEN`` connection that wakes
readers (:mod:`.notifier`). The lowest wing: it imports no other wing."""
