"""The paired A/B benchmark (`python -m bench.ab`): stock SGLang, the ideal cache, stock HiCache and
SGLang + hiradix on the same multi-turn chats. `run` drives it, `systems` defines the systems,
`paired` schedules the requests, `report` and `plots` read the records."""
