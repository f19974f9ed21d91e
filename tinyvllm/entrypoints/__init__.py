"""The OpenAI-compatible HTTP server (`python main.py serve`): FastAPI + uvicorn over AsyncLLM (engine/async_llm.py: the
frontend in this process, the engine core in its own).

api_server builds the app (routes, auth and body-size guard, the engine started beside it, graceful shutdown); protocol holds
the request and response shapes; unsupported the table of request fields the server refuses; serving_completion /
serving_chat / serving_tokenize the endpoints' logic (serving_beam_search the completions' beam search); common the
pieces they share (sampling parameters, prompt checks, streaming many engine requests as one); chat_tools, chat_output,
reasoning_parser and tool_parsers/ the chat reply's tool calls and reasoning; metrics the Prometheus side. Needs the
`serve` extra: pip install -e .[serve]
"""
