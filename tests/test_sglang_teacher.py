"""On-policy distillation's teacher served by SGLang (teacher.backend=sglang, megarl/rollout/sglang_teacher.py).

SGLang needs a GPU, so the server here is a stand-in: an HTTP server answering /generate as SGLang 0.5.23 does for
prompt log-probs (`meta_info.input_token_logprobs`, `[logprob, token_id, text]` per token from `logprob_start_len`
on), every body first checked by SGLang's own GenerateReqInput and SamplingParams (tests/sglang_contract.py), the
log-probs computed by the teacher's real transformers model. Checked: the log-probs land in the columns of the
tokens they score (the Batch's alignment), requests split by size and spread over servers, a failed server's
request goes to the next one, an answer that does not match what was sent stops the step naming the server, the
config's errors, and one real `megarl train` step whose SGLang teacher is the student's own start: reverse KL 0.
"""

from __future__ import annotations

import json
import threading

import pytest
import sglang_contract
import torch
from fake_sglang import QuietHandler, serve
from job_helpers import REPO, megarl_train, metrics, write_config

from megarl.config import load_config
from megarl.data.batch import Batch
from megarl.errors import RunFailure, UserError
from megarl.job import JobConfig
from megarl.rollout.sglang_teacher import SGLangTeacher, samples_of, score_payload


class TeacherStandIn:
    """/generate, /health and /model_info of an SGLang server serving `model` (a transformers causal LM)."""

    def __init__(self, model, *, drop_last: bool = False, fail: bool = False) -> None:
        self.model, self.drop_last, self.fail = model, drop_last, fail
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        stand_in = self

        class Handler(QuietHandler):
            def do_GET(self):
                if self.path == "/model_info":
                    self.reply(200, {"model_path": "/models/teacher", "weight_version": "default"})
                else:
                    self.reply(200, "")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if stand_in.fail:
                    self.reply(500, {"error": {"message": "CUDA error: an illegal memory access"}})
                    return
                sglang_contract.validate_request("/generate", body)
                self.reply(200, stand_in.answer(body))

        self.httpd, self.url, _ = serve(Handler)

    def answer(self, body: dict) -> list[dict]:
        with self.lock:
            self.requests.append(body)
            items = []
            for ids, start in zip(body["input_ids"], body["logprob_start_len"]):
                with torch.no_grad():
                    logits = self.model(torch.tensor([ids])).logits[0].float()
                logprobs = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                entries = [[logprobs[t - 1].item(), ids[t], None] for t in range(start, len(ids))]
                if self.drop_last:
                    entries = entries[:-1]
                meta = {"input_token_logprobs": entries, "output_token_logprobs": [], "finish_reason": None}
                items.append({"text": "", "output_ids": [], "meta_info": meta})
            return items

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megarl.job import ModelInit
    from megarl.trainer.lifecycle.model_init import build_model_folder

    folder = build_model_folder(
        ModelInit(config=str(REPO / "configs/models/tiny-qwen3.json")), tmp_path_factory.mktemp("t") / "model"
    )
    return folder, AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


@pytest.fixture
def stand_ins(teacher_model):
    servers = []

    def start(**kwargs) -> TeacherStandIn:
        servers.append(TeacherStandIn(teacher_model[1], **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def agent_batch() -> Batch:
    """3 right-padded rows: prompts of 3, 2 and 4 tokens; row 1 is an agent episode whose position 5 is a tool's
    observation (outside the response mask, scored all the same)."""
    input_ids = torch.tensor([[5, 6, 7, 20, 21, 0, 0], [8, 9, 30, 31, 32, 33, 34], [1, 2, 3, 4, 40, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    response = torch.tensor([[0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 1], [0, 0, 0, 0, 1, 0, 0]])
    return Batch({"input_ids": input_ids, "attention_mask": attention, "response_mask": response})


def expected_logprobs(model, batch: Batch) -> torch.Tensor:
    """The teacher's log-prob of every token given the ones before it, by a full forward of each row."""
    out = torch.zeros(batch["input_ids"].shape)
    for i, (ids, attention, response) in enumerate(
        zip(*(batch[k] for k in ("input_ids", "attention_mask", "response_mask")))
    ):
        n, first = int(attention.sum()), int(torch.nonzero(response)[0])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids[None, :n]).logits[0].float(), -1)
        for t in range(first, n):
            out[i, t] = logprobs[t - 1, ids[t]]
    return out


def test_samples_and_the_request_follow_the_batch_and_sglangs_own_request_types():
    batch = agent_batch()
    samples = samples_of(batch)
    assert [(s.token_ids, s.start) for s in samples] == [
        ([5, 6, 7, 20, 21], 3),
        ([8, 9, 30, 31, 32, 33, 34], 2),
        ([1, 2, 3, 4, 40], 4),
    ]
    payload = score_payload(samples)
    assert payload["logprob_start_len"] == [3, 2, 4]
    assert payload["sampling_params"][0] == {"max_new_tokens": 0, "temperature": 1.0}
    if sglang_contract.installed():
        request = sglang_contract.validate_request("/generate", payload)
        assert request.logprob_start_len == [3, 2, 4] and request.return_logprob == [True, True, True]


def test_log_probs_land_on_the_tokens_they_score_split_over_requests_and_servers(teacher_model, stand_ins):
    _, model = teacher_model
    batch = agent_batch()
    idle = stand_ins()  # a row with no response token left (all masked): nothing to ask, all zeros
    no_response = Batch(
        {**{k: batch[k][:1] for k in batch.tensors}, "response_mask": torch.zeros(1, 7, dtype=torch.long)}
    )
    assert SGLangTeacher([idle.url]).logprobs(no_response).eq(0).all() and idle.requests == []
    servers = [stand_ins(), stand_ins()]
    teacher = SGLangTeacher([s.url for s in servers], max_request_tokens=12, parallel_requests=2)
    got = teacher.logprobs(batch)
    torch.testing.assert_close(got, expected_logprobs(model, batch), atol=1e-6, rtol=0)
    # 5 + 7 tokens fit one request of 12, the third row goes in a second; one request per server
    assert sorted(len(s.requests) for s in servers) == [1, 1]
    assert sorted(len(r["input_ids"]) for s in servers for r in s.requests) == [1, 2]


def test_a_failing_server_passes_its_request_to_the_next_and_a_wrong_answer_stops(teacher_model, stand_ins):
    _, model = teacher_model
    batch = agent_batch()
    down, up = stand_ins(fail=True), stand_ins()
    got = SGLangTeacher([down.url, up.url], retries=1).logprobs(batch)
    torch.testing.assert_close(got, expected_logprobs(model, batch), atol=1e-6, rtol=0)
    with pytest.raises(RunFailure, match=r"2 tries failed; last: .*HTTP 500: CUDA error"):
        SGLangTeacher([down.url], retries=1).logprobs(batch)
    short = stand_ins(drop_last=True)
    with pytest.raises(
        RunFailure, match=rf"teacher server {short.url}: sample 0 came back with 1 scored tokens for the 2"
    ):
        SGLangTeacher([short.url], retries=0).logprobs(batch)
    assert "serves /models/teacher" in SGLangTeacher([up.url]).describe()[0]
    with pytest.raises(RunFailure, match=r"teacher.sglang.urls: SGLang GET http://127.0.0.1:9/health failed"):
        SGLangTeacher(["http://127.0.0.1:9"]).describe()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], r"teacher.sglang.urls=\[\]: teacher.backend=sglang needs the base URL"),
        (["teacher.sglang.urls=[10.0.0.5:30000]"], r"'10.0.0.5:30000' is not one"),
        (["teacher.sglang.urls=[http://h:1]", "rollout.sampling.temperature=0.7"], r"temperature=0.7: SGLang returns"),
        (
            ["teacher.sglang.urls=[http://h:1]", "teacher.model.path=", "teacher.train.config=configs/quickstart.yaml"],
            r"teacher.backend=sglang needs teacher.model.path",
        ),
        (
            ["teacher.sglang.urls=[http://h:1]", "teacher.sglang.parallel_requests=0"],
            r"parallel_requests=0 must be > 0",
        ),
    ],
)
def test_config_errors_name_the_key(tmp_path, overrides, message):
    config = write_config(
        tmp_path, "[grpo]", 1, "algorithm: {distill_coef: 1.0}\nteacher: {backend: sglang, model: {path: /t}}"
    )
    with pytest.raises(UserError, match=message):
        load_config(JobConfig, config, overrides)


def test_servers_set_for_a_megatron_teacher_are_said_to_do_nothing(tmp_path):
    config = write_config(tmp_path, "[grpo]", 1, "algorithm: {distill_coef: 1.0}\nteacher: {model: {path: /t}}")
    with pytest.warns(
        UserWarning, match=r"teacher.sglang.urls=\['http://h:1'\] has no effect: teacher.backend=megatron"
    ):
        load_config(JobConfig, config, ["teacher.sglang.urls=[http://h:1]"])


def test_a_run_distils_from_an_sglang_teacher_that_is_the_students_start(teacher_model, stand_ins, tmp_path):
    """The server serves the student's own starting weights: the step's reverse KL is 0 up to float32 rounding
    (Megatron's student against transformers' teacher), so every log-prob came back on its own token."""
    folder, _ = teacher_model
    server = stand_ins()
    teacher = f"{{backend: sglang, model: {{path: {folder}}}, sglang: {{urls: [{server.url}]}}}}"
    distill = f"algorithm: {{distill_coef: 1.0}}\nteacher: {teacher}"
    config = write_config(tmp_path, "[grpo]", 1, distill, tp=1)
    out = megarl_train(config, f"model.path={folder}", "rl.eval_at_start=false", "data.eval_files=[]")
    assert f"megarl: teacher: {server.url} serves /models/teacher" in out.stdout
    (record,) = metrics(tmp_path / "run")
    assert record["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert record["distill/reverse_kl_per_sample"] == pytest.approx(0.0, abs=1e-4)
    assert sum(len(r["input_ids"]) for r in server.requests) == 32  # 8 prompts x 4 samples, each scored once


def test_the_plan_counts_a_megatron_teacher_beside_the_actor_or_on_its_own_gpus_and_no_served_one(
    teacher_model, tmp_path
):
    from megarl.plan.planner import run_plan

    folder, _ = teacher_model
    extra = f"algorithm: {{distill_coef: 1.0}}\nteacher: {{model: {{path: {folder}}}}}"
    config = write_config(tmp_path, "[grpo]", 1, extra)
    beside = run_plan(load_config(JobConfig, config))
    assert [role.name for role in beside.roles] == ["actor", "teacher"]
    assert beside.placement.node_map == [
        ("node 0", "actor, teacher (2 GPUs, 2 per node); rollout (2 engines x 1 GPU), taking turns")
    ]
    actor_resident = dict(beside.roles[0].lines)
    assert "resident: 2 worker processes, teacher weights" in actor_resident  # the hf engine is not planned

    own = run_plan(
        load_config(
            JobConfig,
            config,
            ["placement.teacher_gpus=4", "cluster.gpus_per_node=4", "cluster.num_nodes=2", "cluster.address=auto"],
        )
    )
    assert own.placement.node_map == [
        ("node 0", "actor (2 GPUs, 2 per node); rollout (2 engines x 1 GPU), taking turns"),
        ("node 1", "teacher (4 GPUs)"),  # its pool is one node's GPUs: the next node with room
    ]
    actor, teacher = own.roles[:2]
    assert "resident: 1 worker process" in dict(actor.lines)  # no teacher
    assert teacher.layout.startswith("tp 1 | pp 1 | vpp 1 | cp 1 | dp 4")
    assert "resident: 1 worker process" in dict(teacher.lines)
    full = run_plan(load_config(JobConfig, config, ["placement.teacher_gpus=8", "cluster.gpus_per_node=8"]))
    assert (
        "the job needs 16 GPUs (train_gpus=2 + teacher_gpus=8, the teacher's from a node's first GPU); the "
        "cluster has 8" in full.placement.problems[0]
    )

    served = ["teacher.backend=sglang", "teacher.sglang.urls=[http://h:1]"]
    assert [role.name for role in run_plan(load_config(JobConfig, config, served)).roles] == ["actor"]
    with pytest.raises(UserError, match=r"placement.teacher_gpus=1 has no effect with teacher.backend=sglang"):
        load_config(JobConfig, config, [*served, "placement.teacher_gpus=1"])
