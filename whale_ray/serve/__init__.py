"""The live endpoint: the policy, and the agent (θ*, h*), served through Ray Serve with the OpenAI API,
following a run directory's checkpoints as training writes them. `whale serve`, `whale run --serve`.

openai_api.py  the wire format: request models, replies, stream chunks, error objects
spec.py        what an endpoint serves (EndpointSpec), built in the driver
follow.py      reading a run directory: the weights and harness on record
replica.py     one replica without Ray: models, following, admission, completions, streaming
engines.py     where a replica's engines run, by serve.preset: its own process (cpu), the endpoint's engine actor (gpu)
channel.py     the socket between a replica and the engine actor
agent.py       POST /v1/agent/run: h* over the served θ in the sandbox
app.py         the FastAPI routes, the Serve deployment, deploy / undeploy
start.py       `whale serve` and `whale run --serve`: the endpoint started from the command line
"""
