"""``megatron-ring serve``: an OpenAI-compatible HTTP endpoint on rank 0 of a launched job, every rank in lockstep.

* ``schema.py``        the ``serve`` section of an inference config (host, port, cache budget, ...);
* ``conversations.py`` the cached conversations: longest-prefix lookup, least-recently-used eviction;
* ``engine.py``        one rank's scheduler: each round's plan (new requests, cancels) from rank 0,
                       ragged first turns in one packed prefill, follow-up turns, one decode step each;
* ``openai_api.py``    the FastAPI app of rank 0 (chat and text completions, streaming, models, health);
* ``serve_main.py``    one rank of the job; ``serve_cli.py`` the command (checks, then the launcher).
"""
