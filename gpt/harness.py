"""
EleutherAI's lm-evaluation-harness (lm-eval) on this repo's models: GPTLM answers the harness's three kinds of
request with the engine, and run_tasks runs named tasks (hellaswag, arc_easy, ...) through it. Used by
eval.py --tasks and train.py's eval_tasks; imported only when tasks are asked for, since lm-eval is optional.

- loglikelihood: requests that share a context (the endings of a multiple-choice question) run that context
  once into a KV cache and score their continuations together after it; the others run as whole sequences,
  batched. Contexts are tokenized as lm-eval's own Hugging Face backend does, so scores match it.
- loglikelihood_rolling: the whole text's log-likelihood, after the end-of-text token, with the sliding
  window of eval.py's bits per byte.
- generate_until: greedy decoding with the engine, stopped at the request's stop strings.
"""

import difflib
import glob
import os
from collections import defaultdict

import torch
import yaml

from gpt import UserError

try:
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.tasks import TaskManager
except ImportError:  # lm-eval is optional: this module is imported only where tasks are asked for
    raise UserError("lm-eval is not installed; install it with: pip install lm-eval") from None
from gpt.engine import Samples, decode_batch
from gpt.scoring import continuation_logprobs, sequence_logprobs, token_logprobs


class GPTLM(TemplateLM):
    """The model as lm-eval sees it. model: a GPT (put in eval mode here); tokenizer: its Tokenizer."""

    def __init__(self, model, tokenizer, batch_size=8, max_gen_toks=256, stride=None, share_contexts=True):
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_gen_toks, self.stride = batch_size, max_gen_toks, stride
        self.share_contexts = share_contexts  # False: every request as a whole sequence (bench/bench_eval.py)

    @property
    def eot_token_id(self):
        return self.tokenizer.eot  # None for characters: see _loglikelihood_tokens

    def tok_encode(self, string, **kwargs):
        try:
            return self.tokenizer.encode(string)
        except UserError as e:
            raise UserError(f"{e}: this task's text is not in the model's vocabulary; lm-eval tasks need a BPE "
                            "model") from None

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """(log p, is_greedy) of each request ((context, continuation), context tokens, continuation tokens)."""
        results = [None] * len(requests)
        by_context = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            if context == [None]:  # an empty context and no end-of-text token: the first token is the context
                context, continuation = continuation[:1], continuation[1:]
            if not continuation:
                results[i] = (0.0, True)
            else:
                by_context[tuple(context)].append((i, continuation))
        singles = []
        block_size = self.model.config.block_size
        for context, group in by_context.items():
            fits = len(context) + max(len(c) for _, c in group) <= block_size + 1
            if len(group) == 1 or not fits or not self.share_contexts:  # or a context to cut per request
                singles += [(i, list(context), continuation) for i, continuation in group]
                continue
            for (i, _), score in zip(group, continuation_logprobs(self.model, list(context), [c for _, c in group])):
                results[i] = score
        singles.sort(key=lambda s: -len(s[1]) - len(s[2]))  # similar lengths together: less padding
        for start in range(0, len(singles), self.batch_size):
            batch = singles[start:start + self.batch_size]
            for (i, _, _), score in zip(batch, sequence_logprobs(self.model, [(c, s) for _, c, s in batch])):
                results[i] = score
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        results = []
        for (text,) in (request.args for request in requests):
            tokens = self.tok_encode(text)
            if self.eot_token_id is not None:
                tokens = [self.eot_token_id] + tokens  # the text starts a document: every token is predicted
            results.append(token_logprobs(self.model, tokens, self.stride, self.batch_size).sum().item())
        return results

    def generate_until(self, requests, disable_tqdm=False):
        results = []
        for context, gen_kwargs in (request.args for request in requests):
            stops = gen_kwargs.get("until", [])
            stops = [stops] if isinstance(stops, str) else list(stops)
            max_new_tokens = gen_kwargs.get("max_gen_toks", self.max_gen_toks)
            prompt = self.tok_encode(context)[-max(1, self.model.config.block_size - max_new_tokens):]
            settings = dict(num_samples=1, max_new_tokens=max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                            no_kv_cache=False, compile=False)
            samples = Samples(1, self.tokenizer, stops, stream=False)
            decode_batch(self.model, prompt or [self.eot_token_id or 0], settings, samples, generator=None)
            text = samples.texts[0]  # it ends with the stop string that ended it; lm-eval wants the text before
            for stop in stops:
                text = text.split(stop)[0]
            results.append(text)
        return results


def task_manager(tasks, include_path=None):
    """lm-eval's TaskManager for the tasks: with include_path (a folder of task YAML files), that folder alone
    when it holds them all (indexing lm-eval's own thousands of tasks takes ~15 s), else both."""
    if include_path is not None:
        if not os.path.isdir(include_path):
            raise UserError(f"--include_path {include_path}: no such folder")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_tasks for name in tasks):
            return local
    return TaskManager(include_path=include_path)


def task_figures(results):
    """{"task/metric": value} of lm-eval's results: each task's numbers, without their standard errors."""
    return {f"{task}/{key.split(',')[0]}": value for task, metrics in results["results"].items()
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "_stderr" not in key
            and key != "sample_len"}


def check_tasks(tasks, manager, include_path=None):
    """Each name must be a task, group or tag lm-eval knows; an unknown one gets the closest names, or the
    task file in include_path that does not parse (lm-eval skips such files without a word)."""
    known = manager.all_tasks
    for name in tasks:
        if name in known:
            continue
        for path in sorted(glob.glob(os.path.join(include_path or "", "**", "*.yaml"), recursive=True)):
            try:
                with open(path) as f:
                    list(yaml.compose_all(f))  # the YAML syntax only: lm-eval's own tags (!function) need no code
            except yaml.YAMLError as e:
                reason = " ".join(str(e).split())
                raise UserError(f"task file {path} does not parse ({reason}); fix it, then run again") from None
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UserError(f"unknown task {name!r}; {hint}list them with `lm-eval ls tasks`, or pass "
                        "--include_path=DIR holding its YAML")


@torch.inference_mode()
def run_tasks(model, tokenizer, tasks, limit=None, num_fewshot=None, batch_size=8, include_path=None,
              log_samples=False, manager=None):
    """lm-eval's results dict (results, configs, and with log_samples each request's scores) for the tasks.
    manager: a task_manager(tasks, include_path) made before, to reuse (making one takes seconds)."""
    manager = manager or task_manager(tasks, include_path)
    check_tasks(tasks, manager, include_path)
    lm = GPTLM(model, tokenizer, batch_size=batch_size)
    try:
        return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                       task_manager=manager, log_samples=log_samples, batch_size=batch_size)
    except (ConnectionError, OSError) as e:
        raise UserError(f"could not load the data of {', '.join(tasks)} ({str(e).splitlines()[0][:200]}); "
                        "offline, use a cached copy of the dataset or a local task YAML with --include_path") from None


def task_names(text):
    """The task names of a comma-separated setting ("hellaswag, arc_easy")."""
    return [name.strip() for name in text.split(",") if name.strip()]


def task_runner(settings, meta):
    """For train.py's eval_tasks (with its eval_tasks_* and batch_size settings): a function from the model and an
    autocast context to {"task/metric": value}. The task names are checked now, not at the first evaluation. Every
    process runs the tasks on its own unwrapped model (no collective that could hang while rank 0 alone evaluates);
    lm-eval returns results on rank 0 only."""
    from gpt.parallel import whole_root  # the model's root parameters, gathered under FSDP
    from gpt.tokenizer import Tokenizer

    names, tokenizer = task_names(settings["eval_tasks"]), Tokenizer(meta)
    include_path = settings["eval_tasks_include_path"] or None
    try:
        manager = task_manager(names, include_path)
        check_tasks(names, manager, include_path)
    except UserError as e:
        raise as_train_error(e) from None

    def run(model, autocast):
        try:
            with autocast, whole_root(model):
                results = run_tasks(model, tokenizer, names, limit=settings["eval_tasks_limit"],
                                    batch_size=settings["batch_size"], manager=manager)
        except UserError as e:
            raise as_train_error(e) from None
        finally:
            model.train()  # the harness put it in eval mode
        return task_figures(results) if results else {}

    return run


def as_train_error(error):  # eval.py's flag in the message, as train.py spells it
    return UserError("eval_tasks: " + str(error).replace("--include_path", "--eval_tasks_include_path"))
