"""The live endpoint (whale serve): the Serve app, its engine layouts and the replica-to-engine channel."""
