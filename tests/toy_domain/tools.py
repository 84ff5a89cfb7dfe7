"""The toy domain's sandbox tools: none."""

TOOL_SPECS = {}
