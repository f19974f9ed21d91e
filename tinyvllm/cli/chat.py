"""`chat`: an interactive conversation through the model's chat template."""
from __future__ import annotations

import argparse
import sys

from tinyvllm.cli.args import add_engine_args, add_sampling_args, engine_kwargs, model_or_embedded, sampling_kwargs

HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) quits"


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("chat", help="interactive chat using the model's chat template")
  add_engine_args(p)
  p.add_argument("--system", help="system prompt")
  p.add_argument("--no-thinking", action="store_true", help="pass enable_thinking=False to the template (Qwen3)")
  add_sampling_args(p, max_tokens=1024)
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  from tinyvllm.engine.llm import LLM
  from tinyvllm.sampling_params import SamplingParams
  llm = LLM(model_or_embedded(args), **engine_kwargs(args))
  tokenizer = llm.get_tokenizer()
  if tokenizer is None or not tokenizer.has_chat_template:
    print("error: this model's tokenizer has no chat template", file=sys.stderr)
    return 2
  params = SamplingParams(**sampling_kwargs(args))
  template_kwargs = {"enable_thinking": False} if args.no_thinking else {}
  system = [{"role": "system", "content": args.system}] if args.system else []
  history: list[dict] = list(system)
  print(HELP, file=sys.stderr)
  while True:
    try: line = input("> ")
    except (EOFError, KeyboardInterrupt):
      print(file=sys.stderr)
      return 0
    if line.strip() == "/exit": return 0
    if line.strip() == "/reset":
      history = list(system)
      continue
    if not line.strip(): continue
    history.append({"role": "user", "content": line})
    text = tokenizer.apply_chat_template(history, add_generation_prompt=True, **template_kwargs)
    reply = []
    for delta in llm.stream({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}, params):
      reply.append(delta)
      sys.stdout.write(delta)
      sys.stdout.flush()
    sys.stdout.write("\n")
    history.append({"role": "assistant", "content": "".join(reply)})
