"""The engine: the worker process that advances runs. A run is a LangGraph graph (:mod:`.graph`)
whose steps go through the ledger (:mod:`.dispatch`) to specialists over A2A (:mod:`.delegation`,
with what may leave the fleet cut by :mod:`.egress`); :mod:`.worker` takes work messages, holds a
run's lease and records its events. Imports the record and planning wings only."""
