"""Data parallelism on one node: ``data_parallel_size`` engine replicas, each its own process on its own GPUs, behind
one balancer (``balancer.py``). ``launcher.py`` starts and watches the processes (``replica.py``: an engine loop
over a pipe), ``engine.py`` is ``LLMEngine``'s interface over them (``LLM``), ``client.py`` ``AsyncLLMEngine``'s (the
server), ``stats.py`` merges their stats."""
