"""The contract between layercast services: subjects (`subjects`) and schemas (`messages`)."""

from libs.protocol import messages, subjects

__all__ = ["messages", "subjects"]
