"""The A2A surface: the coordinator as an A2A agent. Its cards (:mod:`.card`), the executor that
starts runs and passes follow-ups to them (:mod:`.executor`), the request handler with lossless
resume (:mod:`.handler`), runs as A2A tasks (:mod:`.task_store`, :mod:`.task_events`) and signed push
notifications (:mod:`.push`). Imports every wing below it; nothing imports it but the server."""
