"""The engine part: the vLLM OpenAI server streamrl runs (``streamrl engine``), with what it adds to vLLM
through vLLM's own extension points, each pinned to the vLLM releases it was tested on
(``capture_scheduler.TESTED_VERSIONS``, and in packaging: pyproject.toml's ``cpu`` and ``cuda`` extras):

* ``server.py``: ``Engine`` / ``EngineConfig``, the server's command line and process;
* ``capture.py`` (``--middleware``), ``capture_scheduler.py`` (``--scheduler-cls``), ``capture_outbox.py``:
  token capture, which hands the gateway each call's token ids and logprobs as arrays;
* ``wire.py``: the capture's wire format, and ``lora_slots.py``: the LoRA slots a gateway's policies need (the
  two things the gateway imports from here);
* ``lora_memory.py`` (``--worker-extension-cls``): adapters' host copies in pageable memory.
"""
