"""Harness proposers: read the archive, write new candidate harness files. One role per file:

    base.py           the contract: `Proposer.propose(...)` -> `Session` (proposals + log with usage)
    registry.py       kinds by name (`make_proposer`, `proposer_options`), imported when asked for
    offline.py        `offline`: trace-informed libcst edits without a model, over
      skill.py          the skill text's phrases and function variants
      knobs.py          a harness's knobs and functions, and a numeric knob's next sane values
      edits.py          the edits, and the edits between a parent and its child
      diagnosis.py      what goes wrong in a candidate's traces
    llm.py            `llm`: a built-in agent loop over the openai client (any OpenAI-compatible endpoint)
    agent_cli.py      `agent-cli`: an external coding-agent command in a bubblewrap jail
    archive_tools.py  the read-only archive tools (list, read, grep, diff, frontier, history)
    prompts.py        the Meta-Harness task text, the archive layout and the archive overview
    session.py        usage, prices, budget limits, the session log and where it is stored
    leakage.py        the D_test leakage check the coordinator runs on every candidate

Which candidate is accepted, and which parent a proposer starts from, is `whale_ray.selection`'s call.
Import what you use from its module (this file imports nothing, so no module here loops back to it).
"""
