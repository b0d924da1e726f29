"""The main job: a LLaMA-style byte-level decoder trained with ``fsdp.fully_shard``.

Run it with ``hatch run train`` (``python -m examples.train``); ``--help`` lists the options.
"""
