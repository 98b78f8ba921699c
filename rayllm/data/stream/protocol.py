"""What the stream server (server.py), the nodes' relays (relay.py) and the ranks agree on."""

from __future__ import annotations

END = "end-of-stream"
REPLY_WAIT_S = 5.0  # a call with nothing ready returns empty after this, and the caller asks again
RESTART = "restarting from the latest checkpoint"


class DataStreamLost(RuntimeError):
    """The stream server or a node's relay died or stalled. Not a user error: the attempt fails
    and Ray Train restarts the run from its latest checkpoint, where the server resumes."""
