"""vLLM's `LLM(...)` arguments and `serve` flags (names from vLLM's EngineArgs / LLM docs and `vllm serve --help`):
each works as vLLM's or fails naming itself; none is a TypeError. The same table serves LLM() and the command line."""
from __future__ import annotations

import argparse

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.cli import build_parser, main
from tinyvllm.cli.args import engine_config as cli_engine_config
from tinyvllm.cli.serve import check_server_flags, server_settings
from tinyvllm.config import ConfigError, SpeculativeConfig
from tinyvllm.engine_args import TABLE, engine_config, translate
from tinyvllm.entrypoints.chat_settings import ChatSettings
from tinyvllm.sampling_params import SamplingParamsError

# (vLLM keyword arguments, the EngineConfig fields they must give). Those that set nothing are accepted because they
# describe what tinyvllm does anyway (one device, no remote code, ...).
WORKS: list[tuple[dict, dict]] = [
  ({"tensor_parallel_size": 1}, {}),
  ({"pipeline_parallel_size": 1}, {}),
  ({"data_parallel_size": 1}, {}),
  ({"tensor_parallel_size": 2}, {"tensor_parallel_size": 2}),
  ({"data_parallel_size": 2, "distributed_executor_backend": "ray"}, {"data_parallel_size": 2, "distributed_executor_backend": "ray"}),
  ({"distributed_executor_backend": "uni"}, {}),
  ({"trust_remote_code": True}, {}),
  ({"enforce_eager": True}, {"enforce_eager": True, "cudagraph_mode": "NONE"}),
  ({"max_logprobs": 5}, {"max_logprobs": 5}),
  ({"generation_config": "vllm"}, {"generation_config": "vllm"}),
  ({"override_generation_config": {"temperature": 0.5}}, {"override_generation_config": {"temperature": 0.5}}),
  ({"dtype": "half"}, {"dtype": "float16"}),
  ({"dtype": "float"}, {"dtype": "float32"}),
  ({"dtype": "bfloat16"}, {"dtype": "bfloat16"}),
  ({"device": "auto"}, {}),
  ({"seed": 7}, {"seed": 7}),
  ({"max_model_len": 256}, {"max_model_len": 256}),
  ({"gpu_memory_utilization": 0.5}, {"gpu_memory_utilization": 0.5}),
  ({"kv_cache_memory_bytes": 2**29}, {"kv_cache_memory": 0.5}),
  ({"num_gpu_blocks_override": 64}, {"num_gpu_blocks": 64}),
  ({"block_size": 32}, {"block_size": 32}),
  ({"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8"}),
  ({"enable_prefix_caching": False}, {"enable_prefix_caching": False}),
  ({"max_num_seqs": 8}, {"max_num_seqs": 8}),
  ({"max_num_batched_tokens": 4096}, {"max_num_batched_tokens": 4096}),
  ({"enable_chunked_prefill": False}, {"enable_chunked_prefill": False}),
  ({"long_prefill_token_threshold": 64}, {"long_prefill_token_threshold": 64}),
  ({"swap_space": 8}, {"swap_space": 8}),
  ({"preemption_mode": "swap"}, {"preemption_mode": "swap"}),
  ({"preemption_mode": None}, {"preemption_mode": "recompute"}),
  ({"cpu_offload_gb": 0}, {}),
  ({"disable_custom_all_reduce": True}, {"disable_custom_all_reduce": True}),
  ({"max_seq_len_to_capture": 4096}, {}),
  ({"scheduling_policy": "fcfs"}, {"scheduling_policy": "fcfs"}),
  ({"scheduling_policy": "priority"}, {"scheduling_policy": "priority"}),
  ({"disable_log_stats": True}, {"disable_log_stats": True}),
  ({"skip_tokenizer_init": True}, {"skip_tokenizer_init": True}),
  ({"tokenizer_mode": "auto"}, {}),
  ({"task": "generate"}, {}),
  ({"runner": "generate"}, {}),
  ({"quantization": None}, {}),
  ({"quantization": "awq"}, {"quantization": "awq"}),
  ({"enable_lora": False}, {}),
  ({"speculative_config": None}, {}),
  ({"hf_overrides": {}}, {}),
  ({"served_model_name": "my-model"}, {}),
  ({"async_scheduling": True}, {"async_scheduling": True}),
  ({"revision": "main"}, {"revision": "main"}),
  ({"tokenizer_revision": "v1"}, {"tokenizer_revision": "v1"}),
  ({"hf_token": True}, {"hf_token": True}),
  ({"download_dir": "/tmp/hub"}, {"download_dir": "/tmp/hub"}),
  ({"compilation_config": 0}, {"cudagraph_mode": "NONE"}),
  ({"compilation_config": {"level": 3, "cudagraph_capture_sizes": [1, 2, 4]}}, {"cuda_graph_sizes": [1, 2, 4]}),
  ({"compilation_config": {"cudagraph_mode": "full_decode_only"}}, {"cudagraph_mode": "FULL_DECODE_ONLY"}),
  ({"cudagraph_capture_sizes": [1, 8]}, {"cuda_graph_sizes": [1, 8]}),
  ({"max_cudagraph_capture_size": 16}, {"cuda_graph_sizes": [1, 2, 4, 8, 16]}),
  ({"use_tqdm_on_load": False}, {}),
  ({"logprobs_mode": "raw_logprobs"}, {}),
]

# (vLLM keyword arguments, the words the error must contain: the argument's name first)
REFUSED: list[tuple[dict, list[str]]] = [
  ({"tensor_parallel_size": 0}, ["tensor_parallel_size=0", "integer >= 1"]),
  ({"pipeline_parallel_size": 2}, ["pipeline_parallel_size=2", "pipeline parallelism is not built"]),
  ({"data_parallel_size": 4, "distributed_executor_backend": "uni"}, ["data_parallel_size 4 needs mp or ray"]),
  ({"distributed_executor_backend": "external_launcher"}, ["distributed_executor_backend='external_launcher'"]),
  ({"quantization": "nf4"}, ["quantization must be one of", "'nf4'"]),
  ({"cpu_offload_gb": 4}, ["cpu_offload_gb=4"]),
  ({"enable_lora": True}, ["enable_lora=True", "LoRA"]),
  ({"speculative_config": {"method": "ngram"}}, ["speculative_config", "num_speculative_tokens"]),
  ({"scheduling_policy": "sjf"}, ["scheduling_policy must be one of fcfs, priority"]),
  ({"preemption_mode": "swap", "swap_space": 0}, ["preemption_mode=swap needs swap_space > 0"]),
  ({"tokenizer_mode": "mistral"}, ["tokenizer_mode='mistral'"]),
  ({"hf_overrides": {"rope_theta": 1.0}}, ["hf_overrides"]),
  ({"enable_sleep_mode": True}, ["enable_sleep_mode=True"]),
  ({"task": "embed"}, ["task='embed'"]),
  ({"logprobs_mode": "processed_logits"}, ["logprobs_mode='processed_logits'"]),
  ({"compilation_config": {"level": 3, "use_inductor": True}}, ["compilation_config['use_inductor']"]),
  ({"max_logprobs": 50}, ["max_logprobs must be in [0, 20]"]),
  ({"override_generation_config": {"do_sample": True}}, ["override_generation_config", "do_sample"]),
  ({"dtype": "int8"}, ["dtype must be one of"]),
  ({"load_format": "gguf"}, ["load_format"]),
  ({"reasoning_parser": "deepseek_r1"}, ["reasoning_parser 'deepseek_r1' is not available"]),
  ({"num_gpu_blocks": 8, "num_gpu_blocks_override": 16}, ["num_gpu_blocks", "num_gpu_blocks_override", "give one"]),
  ({"tensor_paralel_size": 1}, ["tensor_paralel_size", "did you mean 'tensor_parallel_size'"]),
  ({"gpu_memory_utilisation": 0.5}, ["gpu_memory_utilisation", "did you mean 'gpu_memory_utilization'"]),
]


def test_the_lists_cover_at_least_30_vllm_arguments():
  names = {k for kwargs, _ in WORKS + REFUSED for k in kwargs}
  assert len(names) >= 30, sorted(names)


@pytest.mark.parametrize(("kwargs", "expected"), WORKS, ids=lambda x: ",".join(x) if isinstance(x, dict) else "")
def test_a_vllm_argument_works(kwargs, expected):
  config = engine_config("some/model", kwargs)
  for field, value in expected.items(): assert getattr(config, field) == value, field


@pytest.mark.parametrize(("kwargs", "words"), REFUSED, ids=lambda x: ",".join(x) if isinstance(x, dict) else "")
def test_a_vllm_argument_it_cannot_honour_fails_naming_it(kwargs, words):
  with pytest.raises(ConfigError) as e: engine_config("some/model", kwargs)
  for word in words: assert word in str(e.value)


def test_accepted_arguments_that_set_nothing_say_so():
  notes: list[str] = []
  engine_config("m", {"trust_remote_code": True, "tensor_parallel_size": 1}, notes.append)
  assert [n.split(" accepted")[0] for n in notes] == ["trust_remote_code=True"]
  assert translate({"trust_remote_code": False})[1] == []   # vLLM's default needs no word


def test_seed_none_draws_a_fresh_seed():
  assert isinstance(engine_config("m", {"seed": None}).seed, int)


def test_llm_takes_vllm_arguments_and_refuses_with_config_errors(stories_dir, reference):
  llm = LLM(str(stories_dir), tensor_parallel_size=1, trust_remote_code=True, enforce_eager=True, swap_space=4,
            disable_custom_all_reduce=True, max_seq_len_to_capture=8192, num_gpu_blocks_override=64, max_logprobs=2,
            generation_config="vllm", scheduling_policy="fcfs", compilation_config={"level": 0}, dtype="float")
  assert llm.engine.allocator.num_blocks == 64 and llm.engine.runner.cudagraph_mode == "NONE"
  out = llm.generate(reference["prompt_ids"], SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)[0]
  assert out.outputs[0].token_ids == reference["greedy_ids"][:8]
  with pytest.raises(SamplingParamsError, match=r"logprobs=3 is more than max_logprobs \(2\)"):
    llm.generate(reference["prompt_ids"], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
  for bad in ({"pipeline_parallel_size": 2}, {"unknown_thing": 1}):
    with pytest.raises(ConfigError): LLM(str(stories_dir), **bad)


def test_skip_tokenizer_init_serves_token_ids(stories_dir, reference):
  llm = LLM(str(stories_dir), skip_tokenizer_init=True, num_gpu_blocks=64)
  assert llm.get_tokenizer() is None
  out = llm.generate({"prompt_token_ids": reference["prompt_ids"]}, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
  assert out.outputs[0].token_ids == reference["greedy_ids"][:5] and out.outputs[0].text == ""
  with pytest.raises(ValueError, match="no tokenizer"): llm.generate("Once", use_tqdm=False)


# ---- the command line --------------------------------------------------------------------------------------------

def serve_args(*argv: str) -> argparse.Namespace:
  return build_parser().parse_args(["serve", *argv])


def test_serve_takes_the_model_positionally_or_by_flag_not_both():
  assert cli_engine_config(serve_args("some/model")).model == "some/model"
  assert cli_engine_config(serve_args("--model", "some/model")).model == "some/model"
  with pytest.raises(ConfigError, match="given twice"): cli_engine_config(serve_args("a/model", "--model", "b/model"))
  from tinyvllm.model.embedded import embedded_model_path
  assert cli_engine_config(serve_args()).model == str(embedded_model_path())   # no model: the one shipped in the package


SERVE_FLAGS: list[tuple[list[str], dict]] = [
  (["-tp", "1"], {}),
  (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
   {"speculative_config": SpeculativeConfig("ngram", 3)}),
  (["-q", "gptq"], {"quantization": "gptq"}),
  (["--quantization", "int4"], {"quantization": "int4"}),
  (["--tensor-parallel-size", "1"], {}),
  (["--trust-remote-code"], {}),
  (["--enforce-eager"], {"cudagraph_mode": "NONE"}),
  (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
  (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
  (["--max-logprobs", "3"], {"max_logprobs": 3}),
  (["--generation-config", "vllm"], {"generation_config": "vllm"}),
  (["--override-generation-config", '{"temperature": 0.2, "max_new_tokens": 9}'],
   {"override_generation_config": {"temperature": 0.2, "max_new_tokens": 9}}),
  (["--disable-log-stats"], {"disable_log_stats": True}),
  (["--swap-space", "8"], {"swap_space": 8.0}),
  (["--preemption-mode", "swap"], {"preemption_mode": "swap"}),
  (["--tokenizer-mode", "auto"], {}),
  (["--scheduling-policy", "fcfs"], {"scheduling_policy": "fcfs"}),
  (["--scheduling-policy", "priority"], {"scheduling_policy": "priority"}),
  (["-O", "0"], {"cudagraph_mode": "NONE"}),
  (["--compilation-config", '{"cudagraph_capture_sizes": [1, 4]}'], {"cuda_graph_sizes": [1, 4]}),
  (["--kv-cache-memory-bytes", str(2**30)], {"kv_cache_memory": 1.0}),
  (["--num-gpu-blocks-override", "32"], {"num_gpu_blocks": 32}),
  (["--dtype", "half"], {"dtype": "float16"}),
  (["--skip-tokenizer-init"], {"skip_tokenizer_init": True}),
  (["--seed", "5"], {"seed": 5}),
  (["-tp", "2", "-dp", "2", "--distributed-executor-backend", "mp"],
   {"tensor_parallel_size": 2, "data_parallel_size": 2, "distributed_executor_backend": "mp"}),
]


@pytest.mark.parametrize(("argv", "expected"), SERVE_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_a_serve_flag_works(argv, expected):
  config = cli_engine_config(serve_args("some/model", *argv))
  for field, value in expected.items(): assert getattr(config, field) == value, field


@pytest.mark.parametrize(("argv", "words"), [
  (["-pp", "2"], ["pipeline_parallel_size=2", "pipeline parallelism is not built"]),
  (["--speculative-config", '{"method": "ngram"}'], ["speculative_config"]),
  (["--enable-lora"], ["enable_lora=True"]),
])
def test_a_serve_flag_it_cannot_honour_fails_naming_it(argv, words):
  with pytest.raises(ConfigError) as e: cli_engine_config(serve_args("some/model", *argv))
  for word in words: assert word in str(e.value)


@pytest.mark.parametrize(("argv", "words"), [
  (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)"]),
  (["--response-role", "bot"], ["--response-role"]),
  (["--enable-log-requests", "--disable-log-requests"], ["--enable-log-requests", "--disable-log-requests"]),
])
def test_server_flags_it_cannot_honour_fail_naming_them(argv, words):
  with pytest.raises(ConfigError) as e: check_server_flags(serve_args("m", *argv))
  for word in words: assert word in str(e.value)


def test_server_flags_reach_the_server_settings(tmp_path):
  template = tmp_path / "template.jinja"
  template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  args = serve_args("m", "--served-model-name", "a", "b", "--chat-template", str(template), "--enable-log-requests",
                    "--max-log-len", "10", "--uvicorn-log-level", "warning", "--root-path", "/api", "--allowed-origins",
                    '["https://x.org"]', "--disable-uvicorn-access-log", "--disable-frontend-multiprocessing", "--response-role",
                    "assistant")
  check_server_flags(args)
  s = server_settings(args)
  assert (s.served_model_name, s.other_model_names, s.chat_template) == ("a", ("b",), template.read_text())
  assert (s.log_requests, s.max_log_len, s.log_level, s.root_path, s.allowed_origins, s.access_log) == \
    (True, 10, "warning", "/api", ["https://x.org"], False)
  inline = server_settings(serve_args("m", "--chat-template", "{{ messages[0]['content'] }}"))
  assert inline.chat_template == "{{ messages[0]['content'] }}"
  assert server_settings(serve_args("m")).access_log and not server_settings(serve_args("m")).log_requests
  tools = server_settings(serve_args("m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--reasoning-parser",
                                     "qwen3", "--trust-request-chat-template", "--exclude-tools-when-tool-choice-none")).chat()
  assert (tools.enable_auto_tool_choice, tools.tool_call_parser, tools.reasoning_parser, tools.trust_request_chat_template,
          tools.exclude_tools_when_tool_choice_none) == (True, "llama3_json", "qwen3", True, True)
  assert server_settings(serve_args("m")).chat() == ChatSettings()


def test_a_chat_template_path_that_is_not_there_is_named(capsys):
  assert main(["serve", "m", "--chat-template", "no/such/template.jinja"]) == 2
  assert "no/such/template.jinja" in capsys.readouterr().err


def test_every_table_flag_parses_with_vllms_spelling():
  flags = [f"--{arg.name.replace('_', '-')}" for arg in TABLE if arg.kind is not None]
  assert len(flags) >= 30
  for flag in flags: assert flag in build_parser()._subparsers._group_actions[0].choices["serve"].format_help(), flag


def test_uds_and_ssl_flags_are_uvicorns_options():
  uvicorn = pytest.importorskip("uvicorn")
  args = serve_args("m", "--uds", "/tmp/tinyvllm.sock", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2",
                    "--root-path", "/v")
  check_server_flags(args)
  options = server_settings(args).uvicorn_options()
  config = uvicorn.Config(lambda scope, receive, send: None, **options)
  assert (config.uds, config.ssl_keyfile, config.ssl_certfile, config.ssl_cert_reqs) == ("/tmp/tinyvllm.sock", "k.pem", "c.pem", 2)
  assert "host" not in options
  with pytest.raises(ConfigError, match="--ssl-keyfile and --ssl-certfile go together"):
    check_server_flags(serve_args("m", "--ssl-keyfile", "k.pem"))
