"""The engine part: the vLLM OpenAI server streamrl runs (``streamrl engine``), with what it adds to vLLM
through vLLM's own extension points, each pinned to the vLLM releases it was tested on
(``vllm_hooks.TESTED_VERSIONS``, and in packaging: pyproject.toml's ``cpu`` and ``cuda`` extras):

* ``server.py``: ``Engine`` / ``EngineConfig``, the server's command line and process;
* ``vllm_hooks.py``: every place streamrl reaches into vLLM, in a table, and streamrl's vLLM plugin
  (``vllm.general_plugins`` entry point) that installs the worker's hooks;
* ``capture.py`` (``--middleware``), ``capture_scheduler.py`` (``--scheduler-cls``), ``capture_outbox.py``:
  token capture, which hands the gateway each call's token ids and logprobs as arrays;
* ``inflight.py``: in-flight updates, running requests moved to their policy's newest version;
* ``wire.py``: the capture's wire format, and ``lora_slots.py``: the LoRA slots a gateway's policies need (the
  two things the gateway imports from here).
"""
