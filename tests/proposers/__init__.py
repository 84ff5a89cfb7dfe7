"""The harness proposers: offline, llm and agent-cli."""
