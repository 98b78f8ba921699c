"""The global stream on Ray: pipeline.py (Ray Data reads, tokenizes and packs each source),
server.py (the driver's stream server), relay.py (one per node), protocol.py (what they and the
ranks agree on)."""
