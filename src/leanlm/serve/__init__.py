"""`leanlm serve`: OpenAI's API on 127.0.0.1 for any model leanlm loads, every conversation in a sink cache."""

from leanlm.serve.api import create_app
from leanlm.serve.conversations import ConversationStore
from leanlm.serve.engine import Engine, Sampling
from leanlm.serve.server import ServeSettings, build_app, serve

__all__ = ["ConversationStore", "Engine", "Sampling", "ServeSettings", "build_app", "create_app", "serve"]
