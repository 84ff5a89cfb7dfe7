"""The sandbox of one untrusted episode: isolation layers, the RPC channel, red-team attacks, the agent-cli jail."""
