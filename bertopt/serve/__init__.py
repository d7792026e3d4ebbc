"""ZeroMQ serving: ``bertopt serve`` (ventilator / workers / sink) speaking bert-as-service's wire protocol.

The client is ``bertopt.client.Client``; see docs/serving.md.
"""
