"""Kafka request/response bridge: ``bertopt kafka`` (see bridge.py for the protocol and delivery guarantee)."""
