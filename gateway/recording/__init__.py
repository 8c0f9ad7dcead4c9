"""The gateway's recording: what turns each served call into Kafka records without ever slowing a response.

* ``recorder.py``: ``Recorder``, the one interface the proxy (``gateway/proxy.py``, which relays HTTP) hands a
  served call to: its context and what the upstream sent in, records out;
* ``capture.py``: a call's context, what a plain vLLM's JSON or stream gives for the record, and the builders
  that turn a call into ``CompletionRecord`` s (run in the producer, off the event loop);
* ``capture_stream.py``: in the producer, the engines' capture streams that deferred calls wait for;
* ``log_producer.py``: ``LogProducer``, which never blocks and never raises: records go through a pipe
  (``gateway/frame_pipe.py``, the one frame format between the gateway's processes) to a child process, or a
  thread, that owns the delivery;
* ``delivery.py``: the Kafka producer and the spool behind it, with their counters;
* ``spool.py``: records kept on disk while the broker cannot take them, replayed in order once it can;
* ``kafka_producers.py``: the two Kafka clients a delivery can use (librdkafka's, kafka-python's).

What it uses from ``broker/`` is what every part uses: the schema, the clients' settings, the security.
"""
