"""Run a recipe as an Amazon SageMaker training job (SageMaker Python SDK v3: ModelTrainer + Torchrun).

The job runs the same `parallel_finetune.train` entry point as a local torchrun, one process per GPU of each
instance. What the job gets, and where:

  code channel   this package, the recipe's folder (less what looks like a secret or is large, each named in a
                 warning), requirements.txt (the versions installed here) and train.py
  training       the rows (train_file/validation_file/test_file, a datasets folder, or a GLUE folder's files)
                 plus their tokenized cache, prepared here: the job tokenizes nothing
  model channel  only when the recipe's model is an s3:// URI: the weights are on the instance before the
                 script starts (no Hub download at start-up)
  checkpoints    /opt/ml/checkpoints, synced with the checkpoint S3 URI (a rerun with the same URI resumes)
  model.tar.gz   the exported Hugging Face folder (SM_MODEL_DIR); with LoRA, adapter/ (and base/) inside it
  output.tar.gz  metrics.jsonl, eval.jsonl, summary.json, tensorboard (SM_OUTPUT_DATA_DIR)

Hyperparameters are the recipe path and the overrides as written, except keys that name local paths (the data
keys, cache_dir, output_dir, and an s3:// model), which become the channel paths above. Every check that can fail on
bad input (instance type, role, region, bucket, credentials, recipe) runs before anything is uploaded.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import logging
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .config import parse_override
from .errors import OneLineArgumentParser, UserError

# resolve.py, loop/ and parallel/ (which import torch) are imported by the functions that use them, so that
# launch_sagemaker.py --help and a bad argument are answered at once, and the job's entry script reads its Hub token
# before anything heavy loads.

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
CHANNELS = Path("/opt/ml/input/data")
# The newest PyTorch training container the SDK knows; the job's pip upgrades its torch to the version in
# requirements.txt (the one this package is tested with) when they differ.
CONTAINER_PYTORCH, CONTAINER_PYTHON = "2.10.0", "py313"
# Multi-node jobs on EFA instances: AWS's recommended NCCL/libfabric settings (p4d/p4de/p5/p5e).
EFA_ENVIRONMENT = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "RDMAV_FORK_SAFE": "1",
    "NCCL_PROTO": "simple",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}
# The trackers' own variables (report_to, loggers.py) that mean the same inside the job: where MLflow runs go (a
# tracking server's URL or a SageMaker-managed MLflow tracking server's ARN) and W&B's mode and project. Never a
# secret (WANDB_API_KEY: give the job its own), nor a path of this machine (WANDB_DIR, a sqlite: or file: store).
TRACKING_ENVIRONMENT = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT")
REMOTE_TRACKING_URI = re.compile(r"^(https?://|arn:aws[\w-]*:sagemaker:|databricks)")


def tracking_environment(environ=os.environ) -> dict[str, str]:
    """The job's copy of this machine's tracker settings; a local MLflow store is left out, with a warning."""
    passed = {name: environ[name] for name in TRACKING_ENVIRONMENT if environ.get(name)}
    uri = passed.get("MLFLOW_TRACKING_URI")
    if uri and not REMOTE_TRACKING_URI.match(uri):
        log.warning(
            "MLFLOW_TRACKING_URI=%s is a store on this machine; the job uses MLflow's default in its container "
            "(give a tracking server's URL or a SageMaker MLflow ARN to see the job's runs)",
            uri,
        )
        del passed["MLFLOW_TRACKING_URI"]
    return passed


EFA_RDMA_INSTANCES = ("ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.p5e.48xlarge")
LOCAL_PATH_KEYS = ("data_dir", "cache_dir", "output_dir", "checkpoint_dir")
# Where the rows can come from: the job gets those stage_data shipped, by their channel paths (train_file beats a
# data_dir also given, as in a local run, so the job's keys are exactly the staged ones).
DATA_KEYS = ("train_file", "validation_file", "test_file", "dataset", "dataset_config", "data_dir")
DATA_CHANNEL = "training"  # /opt/ml/input/data/training: the rows and their tokenized cache
ENTRY_SCRIPT = '''"""SageMaker entry point: the Torchrun driver runs
`torchrun ... train.py --recipe R --key value ...`."""
import sys

from parallel_finetune.sagemaker_job import hub_token_from_secret
from parallel_finetune.train import main

if __name__ == "__main__":
    # HF_TOKEN from the secret HF_TOKEN_SECRET_ARN names (launch_sagemaker.py --hf-token ARN), before any download
    sys.exit(hub_token_from_secret() or main())
'''
# A Hub token for gated checkpoints (Llama, Gemma, ...): `--hf-token env` copies this machine's $HF_TOKEN into the
# job's environment (readable by whoever may describe the job); `--hf-token ARN` names a Secrets Manager secret that
# the job reads at start (its role needs secretsmanager:GetSecretValue on it), so the token is in no job description.
HUB_TOKEN_VARIABLE = "HF_TOKEN"
HUB_TOKEN_SECRET_VARIABLE = "HF_TOKEN_SECRET_ARN"
SECRET_ARN = re.compile(r"arn:aws[\w-]*:secretsmanager:[a-z0-9-]+:\d{12}:secret:[\w/+=.@-]+")
# Left out of the recipe folder's upload, with a warning: names that usually hold credentials or keys, and large
# files (a recipe folder holds YAML; data goes through the training channel, weights through model=s3://).
SECRET_PATTERNS = (
    ".env",
    ".env.*",
    "*.env",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.jks",
    "*.ppk",
    "*.kdbx",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "*credentials*",
    "*secret*",
    ".aws",
    ".ssh",
    ".gnupg",
    ".netrc",
    ".pgpass",
    ".npmrc",
    ".pypirc",
    ".git-credentials",
    ".dockercfg",
)
MAX_RECIPE_FILE_BYTES = 10 * 2**20
# Only what training imports: notebooks, tests and the SageMaker SDK stay on the launching machine.
JOB_EXTRAS = {"deepspeed": ("deepspeed",)}


@dataclass
class JobSettings:
    """Where and on what the job runs. None = from the environment (see `resolve`)."""

    instance_type: str = "ml.p4d.24xlarge"
    instance_count: int = 1
    role: str | None = None  # $SAGEMAKER_ROLE
    region: str | None = None  # $AWS_REGION, $AWS_DEFAULT_REGION
    bucket: str | None = None  # $SAGEMAKER_BUCKET
    prefix: str = "parallel-finetune"
    image_uri: str | None = None  # None = the region's PyTorch training container
    checkpoint_s3_uri: str | None = None  # None = one per job; the same URI again = resume from it
    volume_gb: int = 500
    max_run_hours: float = 24.0
    job_name: str | None = None  # base name; SageMaker's job name adds a timestamp. None = the recipe's name
    hf_token: str | None = None  # "env" ($HF_TOKEN here) or a Secrets Manager ARN; None = the job has no Hub token

    def resolve(self) -> JobSettings:
        """Fill the blanks from the environment; a one-line error for anything still missing or invalid."""
        from .parallel.hardware import INSTANCES

        if self.instance_type not in INSTANCES:
            raise UserError(
                f"instance_type={self.instance_type!r} is not a known GPU training instance; valid: "
                + ", ".join(INSTANCES)
            )
        if not isinstance(self.instance_count, int) or self.instance_count < 1:
            raise UserError(f"instance_count={self.instance_count!r} must be a positive integer")
        role = self.role or os.environ.get("SAGEMAKER_ROLE")
        region = self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        bucket = self.bucket or os.environ.get("SAGEMAKER_BUCKET")
        for name, value, env in (
            ("role", role, "SAGEMAKER_ROLE"),
            ("region", region, "AWS_REGION"),
            ("bucket", bucket, "SAGEMAKER_BUCKET"),
        ):
            if not value:
                raise UserError(
                    f"no SageMaker {name}: pass --{name} (in a notebook: {name.upper()}) or set ${env}"
                    + (" (an IAM role ARN SageMaker can assume)" if name == "role" else "")
                )
        if not re.fullmatch(r"arn:aws[a-z-]*:iam::\d{12}:role/\S+", role):
            raise UserError(f"role={role!r} is not an IAM role ARN (arn:aws:iam::<12-digit account>:role/<name>)")
        if bucket.startswith("s3://") or "/" in bucket:
            raise UserError(f"bucket={bucket!r} must be a bucket name, without s3:// or a path (use --prefix)")
        check_hub_token(self.hf_token)
        return JobSettings(
            self.instance_type,
            self.instance_count,
            role,
            region,
            bucket,
            self.prefix.strip("/"),
            self.image_uri,
            self.checkpoint_s3_uri,
            self.volume_gb,
            self.max_run_hours,
            self.job_name,
            self.hf_token,
        )

    @property
    def gpus_per_instance(self) -> int:
        from .parallel.hardware import INSTANCES

        return INSTANCES[self.instance_type][1]


@dataclass
class Job:
    """A submitted job: its name, links and where its results land."""

    name: str
    region: str
    bucket: str
    output_s3_uri: str
    checkpoint_s3_uri: str
    data_s3_uri: str
    hyperparameters: dict
    trainer: object = field(repr=False, default=None)

    @property
    def console_url(self) -> str:
        return f"https://{self.region}.console.aws.amazon.com/sagemaker/home?region={self.region}#/jobs/{self.name}"

    def status(self) -> str:
        return self._client().describe_training_job(TrainingJobName=self.name)["TrainingJobStatus"]

    def wait(self, poll_seconds: float = 30) -> str:
        """Block until the job ends; its final status (Completed, Failed or Stopped)."""
        while (status := self.status()) in ("InProgress", "Stopping"):
            time.sleep(poll_seconds)
        return status

    def download(self, folder: str | Path) -> Path:
        """Fetch and unpack model.tar.gz (into folder/hf) and output.tar.gz (metrics, summary) into `folder`."""
        folder = Path(folder)
        description = self._client().describe_training_job(TrainingJobName=self.name)
        if description["TrainingJobStatus"] != "Completed":
            raise UserError(
                f"job {self.name} is {description['TrainingJobStatus']}, not Completed: nothing to "
                f"download yet ({self.console_url})"
            )
        model_uri = description["ModelArtifacts"]["S3ModelArtifacts"]
        output_uri = model_uri.rsplit("/", 1)[0] + "/output.tar.gz"
        s3 = self._session().client("s3")
        for uri, target in ((model_uri, folder / "hf"), (output_uri, folder)):
            bucket, key = split_s3_uri(uri)
            target.mkdir(parents=True, exist_ok=True)
            archive = folder / Path(key).name
            s3.download_file(bucket, key, str(archive))
            with tarfile.open(archive) as tar:
                tar.extractall(target, filter="data")
            archive.unlink()
        return folder

    def _session(self):
        import boto3

        return boto3.Session(region_name=self.region)

    def _client(self):
        return self._session().client("sagemaker")


def check_hub_token(hf_token: str | None, environ=os.environ) -> None:
    """--hf-token: "env" with $HF_TOKEN set here, or a Secrets Manager secret's ARN. The value itself is never
    repeated in an error: a token pasted in its place must not end up in a terminal's scrollback or a CI log."""
    if hf_token is None or (hf_token == "env" and environ.get(HUB_TOKEN_VARIABLE)) or SECRET_ARN.fullmatch(hf_token):
        return
    if hf_token == "env":
        raise UserError(
            f"--hf-token env: ${HUB_TOKEN_VARIABLE} is not set here; export {HUB_TOKEN_VARIABLE}=<a read token of "
            "the Hub account that accepted the model's licence>, or pass a Secrets Manager secret's ARN"
        )
    raise UserError(
        "--hf-token: neither `env` nor a Secrets Manager secret's ARN (arn:aws:secretsmanager:<region>:<account>:"
        "secret:<name>); never the token itself, which would show in the job's description and your shell history"
    )


def job_environment(settings: JobSettings, environ=os.environ) -> dict[str, str]:
    """The job's environment variables: quiet Hub downloads, the trackers' settings, the Hub token as --hf-token
    says, and on multi-node EFA instances AWS's NCCL settings."""
    environment = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", **tracking_environment(environ)}
    check_hub_token(settings.hf_token, environ)
    if settings.hf_token == "env":
        environment[HUB_TOKEN_VARIABLE] = environ[HUB_TOKEN_VARIABLE]
        log.info(
            "the job gets $%s from this environment (whoever may describe the job can read it; --hf-token "
            "<secret ARN> keeps it in Secrets Manager)",
            HUB_TOKEN_VARIABLE,
        )
    elif settings.hf_token:
        environment[HUB_TOKEN_SECRET_VARIABLE] = settings.hf_token
        log.info("the job reads its Hub token from %s at start", settings.hf_token)
    if settings.instance_count > 1 and settings.instance_type in EFA_RDMA_INSTANCES:
        environment.update(EFA_ENVIRONMENT)
    return environment


def hub_token_from_secret(environ=os.environ) -> int:
    """In the job, before training: $HF_TOKEN from the secret $HF_TOKEN_SECRET_ARN names (its string, or its
    "HF_TOKEN" key when it holds JSON key/value pairs, as the console's form stores them). 0, or 2 after one line."""
    arn = environ.get(HUB_TOKEN_SECRET_VARIABLE)
    if not arn or environ.get(HUB_TOKEN_VARIABLE):
        return 0
    import json

    import boto3
    import botocore.exceptions

    region = arn.split(":")[3]
    try:
        secret = boto3.Session(region_name=region).client("secretsmanager").get_secret_value(SecretId=arn)
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
        print(
            f"error: {HUB_TOKEN_SECRET_VARIABLE}={arn}: the secret could not be read ({type(exc).__name__}); the "
            "job's role needs secretsmanager:GetSecretValue on it (and kms:Decrypt for a customer key)",
            file=sys.stderr,
        )
        return 2
    token = secret.get("SecretString") or ""
    try:
        pairs = json.loads(token)
    except ValueError:
        pairs = None
    if isinstance(pairs, dict):
        token = pairs.get(HUB_TOKEN_VARIABLE) or ""
    if not token.strip():
        print(
            f"error: {HUB_TOKEN_SECRET_VARIABLE}={arn}: the secret holds no token (store it as plain text, or as "
            f'JSON {{"{HUB_TOKEN_VARIABLE}": "hf_..."}})',
            file=sys.stderr,
        )
        return 2
    environ[HUB_TOKEN_VARIABLE] = token.strip()
    return 0


def split_s3_uri(uri: str) -> tuple[str, str]:
    match = re.fullmatch(r"s3://([^/]+)/?(.*)", uri)
    if not match:
        raise UserError(f"{uri!r} is not an S3 URI (s3://bucket/key)")
    return match.group(1), match.group(2)


# ----------------------------------------------------------------------------------------------- staging


def job_requirements(engine: str, model: str | None = None) -> list[str]:
    """This package's dependencies pinned to the versions installed here, so the job runs what was tested
    (plus DeepSpeed for engine=deepspeed, and the pip package behind a `model: package:MODULE`)."""
    try:
        declared = importlib.metadata.requires("parallel-finetune") or []
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            "the parallel-finetune package is not installed (pip install -e . or pip install "
            "git+<repository>); the job's requirements come from its metadata"
        ) from None
    names = [
        re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
        for requirement in declared
        if "extra ==" not in requirement
    ]
    names += JOB_EXTRAS.get(engine, ())
    if model and model.startswith("package:"):
        module = model.split(":", 1)[1].split(".")[0]
        names += importlib.metadata.packages_distributions().get(module, [module])
    pinned = []
    for name in names:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise UserError(
                f"{name} is not installed here, so its version for the job is unknown; pip install "
                f"-r requirements-all.txt first"
            ) from None
        pinned.append(f"{name}=={version.split('+')[0]}")  # 2.13.0+cpu here -> the CUDA build of 2.13.0 there
    return pinned


def _recipe_files_to_skip(root: Path, skipped: list[str]) -> Callable[[str, list[str]], set[str]]:
    """copytree's `ignore` for the recipe folder: caches and hidden files (as always), and, each named in
    `skipped`, files that look like secrets, links out of the folder, and files too large for a code channel."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        left_out = set()
        for name in names:
            path = Path(directory) / name
            where = path.relative_to(root)
            if any(fnmatch.fnmatch(name.lower(), pattern) for pattern in SECRET_PATTERNS):
                skipped.append(f"{where} (looks like a secret)")
            elif name.startswith(".") or name == "__pycache__":
                pass
            elif path.is_symlink() and not path.resolve().is_relative_to(root.resolve()):
                skipped.append(f"{where} (a link to {path.resolve()}, outside the folder)")
            elif path.is_file() and path.stat().st_size > MAX_RECIPE_FILE_BYTES:
                skipped.append(
                    f"{where} ({path.stat().st_size / 2**20:.0f} MiB, over {MAX_RECIPE_FILE_BYTES >> 20} MiB)"
                )
            else:
                continue
            left_out.add(name)
        return left_out

    return ignore


def stage_code(recipe: Path, config, folder: Path) -> str:
    """The code channel: package, recipe folder, requirements, entry script. Returns the recipe's path in it."""
    shutil.copytree(PACKAGE_DIR, folder / "parallel_finetune", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # The whole folder, so that `extends:` between a recipe and its siblings keeps working; not what looks like a
    # secret (the job's S3 prefix and logs are readable by more people than a laptop) or a large file.
    skipped: list[str] = []
    shutil.copytree(recipe.parent, folder / "recipe", ignore=_recipe_files_to_skip(recipe.parent, skipped))
    if skipped:
        log.warning("not uploading from %s: %s; the job gets the rest of the folder", recipe.parent, ", ".join(skipped))
    shipped = sorted(str(p.relative_to(folder)) for p in (folder / "recipe").rglob("*") if p.is_file())
    log.info("code channel: the parallel_finetune package, requirements.txt, train.py, %s", ", ".join(shipped))
    (folder / "requirements.txt").write_text(
        "\n".join(job_requirements(config.parallel.engine, config.model.source)) + "\n"
    )
    (folder / "train.py").write_text(ENTRY_SCRIPT)
    return f"recipe/{recipe.name}"


def stage_data(config, folder: Path) -> tuple[dict[str, str], str]:
    """The data channel: the rows as this machine has them (train_file/validation_file/test_file, a datasets folder,
    or a GLUE folder's files) plus their tokenized cache, in `folder`. Returns the data keys that point the job at
    the channel (its paths) and the cache folder's name.

    The job finds the cache because its key hashes the files' names and bytes and the tokenizer, not their paths:
    files keep their names here (one that shares another's name goes into a folder named for its split)."""
    from .loop.builder import prepare_data
    from .tasks.glue import TASKS
    from .tasks.sources import SHIPPED_SAMPLES, glue_folder_files

    local_dataset = bool(config.data.dataset) and Path(config.data.dataset).expanduser().is_dir()
    # task=sft or dpo without rows of the user's: the sample shipped in the package, which the code channel carries,
    # so only its tokenized cache is staged (the job's copy of the sample has the same bytes, so the same cache key)
    shipped_sample = config.model.task in SHIPPED_SAMPLES and not (config.data.train_file or config.data.dataset)
    if not (
        shipped_sample or config.data.train_file or local_dataset or (config.data.data_dir and not config.data.dataset)
    ):
        wanted = (
            f"dataset={config.data.dataset!r} is a Hub data set: save it with datasets' save_to_disk and pass "
            "dataset=FOLDER"
            if config.data.dataset
            else f"glue_task={config.data.glue_task} from the Hub: pass data_dir=PATH, a folder with GLUE's "
            f"{', '.join(TASKS[config.data.glue_task].split_files().values())}"
        )
        raise UserError(f"a SageMaker job trains on rows shipped from this machine; {wanted}, or train_file=PATH")
    # read and tokenized from the user's paths (a bad row names the user's file); the cache made by an earlier run
    # or `make data` is reused as is
    prepared = prepare_data(config)
    folder.mkdir(parents=True)
    staged: dict[str, str] = {}
    if config.data.train_file:
        for key in ("train_file", "validation_file", "test_file"):
            if getattr(config, key):
                path = Path(getattr(config, key)).expanduser()
                name = path.name if path.name not in staged.values() else f"{key.split('_')[0]}/{path.name}"
                (folder / name).parent.mkdir(exist_ok=True)
                shutil.copy(path, folder / name)
                staged[key] = name
    elif config.data.dataset:
        shutil.copytree(Path(config.data.dataset).expanduser(), folder / "dataset")
        staged["dataset"] = "dataset"
    elif not shipped_sample:
        for path in glue_folder_files(TASKS[config.data.glue_task], Path(config.data.data_dir).expanduser()).values():
            if path.is_file():
                shutil.copy(path, folder / path.name)
        staged["data_dir"] = ""
    cache = folder / "cache"
    shutil.copytree(prepared.cache_path, cache / prepared.cache_path.name)
    # a tiny tokenizer's folder: <kind><vocab>-pairs-<source fingerprint>-<sentences' digest> (one learned with a chat
    # template's specials ends in their digest too, and is not staged: the job learns it again, as before)
    tokenizers = Path(config.data.cache_dir).expanduser() / "tokenizers"
    for tokenizer in tokenizers.glob(f"*-{prepared.source.fingerprint}-" + "?" * 8):
        shutil.copytree(tokenizer, cache / "tokenizers" / tokenizer.name)
    log.info("data for the job: %s (%s)", prepared.cache_path.name, prepared.source.description)
    channel = CHANNELS / DATA_CHANNEL
    return {key: str(channel / name) for key, name in staged.items()}, prepared.cache_path.name


def load_config_like(config, **changes):

    return config.replace(**changes)


def fetch_tokenizer_files(boto_session, model_uri: str, folder: Path) -> Path:
    """Everything in an S3 model folder except the weights: enough to tokenize the data here."""
    from .model.weights import WEIGHT_FILES

    # what a tokenizer needs none of: the loader's weight files, and other frameworks' (raw torch, TF, Flax, GGUF)
    other_frameworks = (".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf")
    weights = tuple(Path(single).suffix for _, single, _ in WEIGHT_FILES) + other_frameworks
    bucket, prefix = split_s3_uri(model_uri.rstrip("/") + "/")
    s3 = boto_session.client("s3")
    found = False
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            relative = item["Key"][len(prefix) :]
            found = True
            if relative and "/" not in relative and not relative.endswith(weights):
                folder.mkdir(parents=True, exist_ok=True)
                s3.download_file(bucket, item["Key"], str(folder / relative))
    if not found:
        raise UserError(
            f"model={model_uri!r}: no files under that S3 prefix (expected a Hugging Face model "
            "folder: config.json, tokenizer files, weights)"
        )
    return folder


def job_hyperparameters(
    recipe_in_code: str, overrides: list[str], model_is_s3: bool, data_keys: dict[str, str]
) -> dict[str, str]:
    """The overrides as written (SageMaker shows and passes them on), local paths swapped for channel paths
    (`data_keys`: stage_data's)."""
    hyperparameters = {"recipe": recipe_in_code}
    for text in overrides:
        key, _ = parse_override(text)
        if key in LOCAL_PATH_KEYS or key in DATA_KEYS or (key == "model" and model_is_s3):
            continue
        hyperparameters[key] = text.split("=", 1)[1].strip()
    hyperparameters.update(data_keys)
    hyperparameters["cache_dir"] = str(CHANNELS / DATA_CHANNEL / "cache")
    if model_is_s3:
        hyperparameters["model"] = str(CHANNELS / "model")
    return hyperparameters


# ----------------------------------------------------------------------------------------------- launching


def _check_aws(settings: JobSettings):
    """Credentials and bucket, before any upload; returns the boto3 session."""
    import boto3
    import botocore.exceptions

    session = boto3.Session(region_name=settings.region)
    if session.get_credentials() is None:
        raise UserError(
            "no AWS credentials found: run `aws configure` (or `aws sso login`), or set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    try:
        session.client("s3").head_bucket(Bucket=settings.bucket)
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        why = "does not exist" if code in ("404", "NoSuchBucket") else f"is not accessible ({code})"
        raise UserError(
            f"bucket={settings.bucket!r} {why}; create it in {settings.region} or pass another "
            "--bucket (in a notebook: BUCKET)"
        ) from None
    except botocore.exceptions.BotoCoreError as exc:
        raise UserError(f"cannot reach S3 in {settings.region}: {exc}") from None
    return session


def check_job_layout(config, settings: JobSettings, model_folder: Path | None) -> str:
    """The recipe's layout on the job's GPUs (degrees dividing heads, blocks and batch), checked here: a bad one
    would otherwise surface minutes into a paid job. The model's config comes from `config_for`, as in the job:
    a published checkpoint's sizes from its family (offline), else the S3 model's own config.json or the Hub's."""
    from .preflight import check_layout
    from .resolve import choose_model

    chosen = choose_model(config)
    family = chosen.family
    name = str(model_folder) if model_folder else chosen.model_name
    try:
        hf_config = family.config_for(
            model=config.model,
            head=chosen.head,
            max_length=config.data.max_length,
            tokenizer_size=config.model.tokenizer_vocab_size,
            model_path=name,
            published=True,
        )
    except OSError as exc:
        raise UserError(
            f"model={name!r}: its config.json could not be read ({exc.__class__.__name__}); "
            "pass a Hub name, model=s3://... or check the network"
        ) from None
    gpus = settings.gpus_per_instance
    degrees, pipeline = check_layout(config, hf_config, gpus * settings.instance_count, gpus)
    return (
        f"{settings.instance_count} x {settings.instance_type} = {pipeline}{degrees.dp} data-parallel x "
        f"{degrees.tp} tensor-parallel"
    )


def training_image(settings: JobSettings) -> str:
    if settings.image_uri:
        return settings.image_uri
    from sagemaker.core import image_uris

    return image_uris.retrieve(
        framework="pytorch",
        region=settings.region,
        version=CONTAINER_PYTORCH,
        py_version=CONTAINER_PYTHON,
        instance_type=settings.instance_type,
        image_scope="training",
    )


def _model_is_s3(model: str | None) -> bool:
    """model= an S3 URI (the job reads it as an input channel), else a Hub name; a local folder is refused."""
    if model and model.startswith("s3://"):
        split_s3_uri(model)
        return True
    if model and Path(model).expanduser().is_dir():
        raise UserError(
            f"model={model!r} is a local folder the job cannot read: upload it "
            "(aws s3 sync FOLDER s3://bucket/models/NAME) and pass model=s3://bucket/models/NAME"
        )
    return False


def _model_trainer(session, settings: JobSettings, base_name: str, code: Path, hyperparameters: dict, environment):
    """The SDK's ModelTrainer for the job: the staged `code` run by torchrun on every instance's GPUs."""
    from sagemaker.train import ModelTrainer
    from sagemaker.train.configs import CheckpointConfig, Compute, OutputDataConfig, SourceCode, StoppingCondition
    from sagemaker.train.distributed import Torchrun

    return ModelTrainer(
        sagemaker_session=session,
        role=settings.role,
        base_job_name=base_name,
        training_image=training_image(settings),
        source_code=SourceCode(source_dir=str(code), requirements="requirements.txt", entry_script="train.py"),
        distributed=Torchrun(process_count_per_node=settings.gpus_per_instance),
        compute=Compute(
            instance_type=settings.instance_type,
            instance_count=settings.instance_count,
            volume_size_in_gb=settings.volume_gb,
        ),
        stopping_condition=StoppingCondition(max_runtime_in_seconds=int(settings.max_run_hours * 3600)),
        # No URI: the SDK's default, s3://bucket/prefix/<base name>/<job>/checkpoints.
        checkpoint_config=CheckpointConfig(s3_uri=settings.checkpoint_s3_uri),
        output_data_config=OutputDataConfig(s3_output_path=f"s3://{settings.bucket}/{settings.prefix}/output"),
        hyperparameters=hyperparameters,
        environment=environment,
    )


def launch(
    recipe: str | Path, overrides: list[str] = (), settings: JobSettings | None = None, wait: bool = False
) -> Job:
    """Validate everything, stage and upload code and data, submit the job. With `wait`, also wait for it."""
    from .resolve import load_config

    overrides = list(overrides)
    settings = (settings or JobSettings()).resolve()
    recipe = Path(recipe).expanduser()
    config = load_config(recipe, overrides)  # bad keys or values end here, before any upload
    model_is_s3 = _model_is_s3(config.model.source)
    boto_session = _check_aws(settings)

    from sagemaker.core.helper.session_helper import Session
    from sagemaker.train.configs import InputData

    # The SDK appends a timestamp to this base name; it also names the job's S3 folder.
    base_name = re.sub(r"[^a-zA-Z0-9-]", "-", settings.job_name or config.recipe)[:40].strip("-")
    base = f"s3://{settings.bucket}/{settings.prefix}"
    session = Session(
        boto_session=boto_session, default_bucket=settings.bucket, default_bucket_prefix=settings.prefix or None
    )
    with tempfile.TemporaryDirectory(prefix="sagemaker-job-") as tmp:
        tmp = Path(tmp)
        prep_config, model_folder = config, None
        if model_is_s3:  # tokenize with the model's own tokenizer files, as the job will read them
            model_folder = fetch_tokenizer_files(boto_session, config.model.source, tmp / "tokenizer")
            prep_config = load_config_like(config, model=str(model_folder))
        log.info("layout: %s", check_job_layout(config, settings, model_folder))
        recipe_in_code = stage_code(recipe, config, tmp / "code")
        data_keys, cache_key = stage_data(prep_config, tmp / DATA_CHANNEL)
        # Keyed by the cache folder's name (data and tokenizer hashes): a later job with the same data reuses it.
        data_uri = session.upload_data(
            str(tmp / DATA_CHANNEL), bucket=settings.bucket, key_prefix=f"{settings.prefix}/data/{cache_key}"
        )
        hyperparameters = job_hyperparameters(recipe_in_code, overrides, model_is_s3, data_keys)
        inputs = [InputData(channel_name=DATA_CHANNEL, data_source=data_uri)]
        if model_is_s3:
            inputs.append(InputData(channel_name="model", data_source=config.model.source))
        environment = job_environment(settings)
        trainer = _model_trainer(session, settings, base_name, tmp / "code", hyperparameters, environment)
        trainer.train(input_data_config=inputs, wait=False, logs=False)
    submitted = trainer._latest_training_job
    job = Job(
        submitted.training_job_name,
        settings.region,
        settings.bucket,
        f"{base}/output/{submitted.training_job_name}",
        submitted.checkpoint_config.s3_uri,
        data_uri,
        hyperparameters,
        trainer,
    )
    log.info("submitted %s: %s", job.name, job.console_url)
    if wait:
        job.wait()
    return job


# ----------------------------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """scripts/launch_sagemaker.py RECIPE [key=value ...] [--instance-type T --instance-count N --wait ...]"""
    defaults = JobSettings()
    parser = OneLineArgumentParser(
        prog="launch_sagemaker.py",
        description="Submit a recipe as a SageMaker training job (torchrun, one process per GPU). Role, region "
        "and bucket default to $SAGEMAKER_ROLE, $AWS_REGION and $SAGEMAKER_BUCKET.",
    )
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/gptj/tp.yaml")
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value (data_dir= is prepared here)")
    parser.add_argument(
        "--instance-type",
        default=defaults.instance_type,
        help="a GPU training instance, e.g. ml.p4d.24xlarge (the default), ml.p5.48xlarge, ml.g5.48xlarge; "
        "another is answered with the list",
    )
    parser.add_argument("--instance-count", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--role", help="IAM role ARN for the job")
    parser.add_argument("--region", help="AWS region")
    parser.add_argument("--bucket", help="S3 bucket for code, data, checkpoints and results")
    parser.add_argument("--prefix", default=defaults.prefix, help="S3 key prefix (default %(default)s)")
    parser.add_argument(
        "--image-uri", help=f"training container (default: the region's PyTorch {CONTAINER_PYTORCH} training image)"
    )
    parser.add_argument("--checkpoint-s3-uri", help="checkpoints; reuse a job's URI to resume it")
    parser.add_argument("--job-name", help="base job name (default: the recipe's, e.g. gptj-tp)")
    parser.add_argument("--max-run-hours", type=float, default=defaults.max_run_hours)
    parser.add_argument("--wait", action="store_true", help="wait for the job to end")
    parser.add_argument("--download", metavar="DIR", help="with --wait: fetch the model and metrics into DIR")
    parser.add_argument(
        "--hf-token",
        metavar="env|ARN",
        help="a Hub token for gated models: `env` passes this shell's $HF_TOKEN in the job's environment; a Secrets "
        "Manager secret's ARN is read by the job itself (docs/multi-node.md)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("sagemaker", "sagemaker.config", "botocore", "boto3", "urllib3", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    settings = JobSettings(
        args.instance_type,
        args.instance_count,
        args.role,
        args.region,
        args.bucket,
        args.prefix,
        args.image_uri,
        args.checkpoint_s3_uri,
        max_run_hours=args.max_run_hours,
        job_name=args.job_name,
        hf_token=args.hf_token,
    )
    try:
        check_hub_token(args.hf_token)  # before torch is imported, as the other arguments are
        job = launch(args.recipe, args.overrides, settings)
        print(
            f"job {job.name}\n  console  {job.console_url}\n  output   {job.output_s3_uri}\n"
            f"  checkpoints {job.checkpoint_s3_uri}"
        )
        if args.wait or args.download:
            status = job.wait()
            print(f"job {job.name}: {status}")
            if args.download:
                print(f"results in {job.download(args.download)}")
            return 0 if status == "Completed" else 1
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(
            f"error: {exc.name} is missing: make setup-all, or pip install -r requirements-all.txt (it brings "
            "sagemaker-train)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
