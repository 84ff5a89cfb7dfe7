"""The search_qa domain's sandbox tools. STANDARD LIBRARY ONLY: this file is copied into the sandbox.

There are none: retrieval needs the corpus and its index, which live in the trusted Retriever actor, so
`search` is a host tool (Domain.host_tools) that the harness reaches over the sandbox's RPC channel:

    agent.tool("search", query="Oren Taltavi", topk=1)
    -> "Doc 1(Title: Oren Taltavi) Oren Taltavi was a painter born in Velmora in 1874."
"""

TOOL_SPECS = {}
