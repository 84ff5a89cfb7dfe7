"""The domains and their worlds: loaders, data layouts, verifiers, tools, h0 and skill.md."""
