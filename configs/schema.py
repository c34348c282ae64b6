"""Typed Hydra configs. The dataclasses here are the schemas; the YAML files beside this module are
presets and defaults. Registering them in Hydra's ConfigStore makes every key typed, so a typo or an
unknown key fails at start-up with the list of valid keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from model.args import ModelArgs


@dataclass
class ParallelConfig:
    """How ranks are arranged. World size = dp * cp * tp; dp is whatever is left."""

    # Tensor-parallel degree: ranks that split every matmul (inside one NVLink node).
    tp: int = 1
    # Context-parallel (Ulysses) degree: ranks that split the sequence around attention.
    cp: int = 1
    # Communication path for tensor/sequence parallel ops: torch | symm_mem | triton.
    comm: str = "torch"
    # Data parallelism with FSDP2 (fully_shard: parameters, gradients and optimizer state sharded; each
    # block's weights gathered in training.dtype) even when tp = cp = 1 (else DDP there). Always used over
    # dp when tp * cp > 1.
    fsdp: bool = False
    # HSDP: the dp ranks form this many replicas of the model (outermost ranks: set the node count), each
    # sharded by FSDP2 over its dp / dp_replicate ranks (and cp), so that weights are gathered within a
    # node and only gradients cross nodes (all-reduced between replicas); above 1 it implies FSDP2 (as
    # parallel.fsdp=true). 1: FSDP2, where used, shards over every dp rank.
    dp_replicate: int = 1


@dataclass
class TrainingConfig:
    # Optimizer steps; the learning-rate schedule spans them.
    steps: int = 300
    # Sequences per data-parallel rank per micro-batch (the tp and cp ranks of one model replica share
    # theirs): an optimizer step trains on batch_size * grad_accum * dp sequences.
    batch_size: int = 16
    # Tokens per sequence (at most model.max_seq_len).
    seq_len: int = 128
    # Micro-batches accumulated into one optimizer step.
    grad_accum: int = 1
    # Peak learning rate of AdamW, reached when the warm-up ends.
    lr: float = 3e-3
    # Cosine decay ends at lr * min_lr_ratio, on the last step.
    min_lr_ratio: float = 0.1
    # Linear warm-up: step i (from 1) trains at lr * i / warmup_steps.
    warmup_steps: int = 20
    # AdamW's decoupled weight decay, on every matrix (the embedding and output projection too); the
    # norms' weights get none.
    weight_decay: float = 0.1
    # AdamW's decay of its running mean of the gradients.
    beta1: float = 0.9
    # AdamW's decay of its running mean of the squared gradients (its eps is PyTorch's default, 1e-8).
    beta2: float = 0.95
    # Clip the global gradient norm to this value (0 disables clipping); the logged grad_norm is the
    # norm before clipping.
    grad_clip: float = 1.0
    # Seeds the initial weights (unless checkpoint.init_from gives them) and the order of the data.
    seed: int = 0
    # Stop (after saving a checkpoint) at this step as if interrupted; running again resumes (a resume
    # refuses a stop_at it has reached: drop it, or set a later one).
    stop_at: int | None = None
    # Resume even though steps, lr, warmup_steps, min_lr_ratio, weight_decay, beta1 or beta2 differ
    # from the checkpoint's: the new values apply from the next step (the learning rate jumps to the
    # new schedule's value there). Without it such a resume is refused, naming the changes.
    allow_schedule_change: bool = False
    # Autocast dtype on GPU (bfloat16 | float32); CPU always trains in float32.
    dtype: str = "bfloat16"
    # torch.compile the model (each transformer block when parallel.tp, cp or fsdp shard it).
    compile: bool = False
    # Recompute each transformer block in the backward (less activation memory).
    activation_checkpointing: bool = False


@dataclass
class DataConfig:
    # None: Python's own documentation topics (shipped with Python). Else a .jsonl file (a document per
    # line), a UTF-8 text file (.txt, .md, .rst, .py, .text: one document) or a directory of such files;
    # any of these is tokenized once into cache_dir. Or a .npy file holding a 1-D integer array of token
    # ids (tokenized elsewhere: memory-mapped as it is, each id checked to be below model.vocab_size).
    path: str | None = None
    # Field holding the text in each line of a .jsonl file.
    jsonl_field: str = "text"
    # Where the corpus' token ids are kept (2 bytes a token, 4 with over 65536 ids), one file per corpus,
    # jsonl_field and tokenizer, named by a hash of them (a corpus file's path, size and modification
    # time): the first launch tokenizes (under torchrun, rank 0, then LOCAL_RANK 0 of a node that cannot
    # see rank 0's file; the other ranks wait), later ones and every rank memory-map the file. None:
    # $XDG_CACHE_HOME/weft/tokens, else ~/.cache/weft/tokens. Files there can be deleted while no run
    # reads them: a launch rebuilds what it needs (a build killed outright leaves a
    # <name>.tmp-<host>-<pid> file, never read, which the next launch on that host deletes).
    cache_dir: str | None = None


@dataclass
class CheckpointConfig:
    # Save every N optimizer steps (and always at the end); 0 saves only at the end.
    every: int = 100
    # Number of newest checkpoints kept in the run directory.
    keep: int = 2
    # Start from these weights: a weft checkpoint directory or a Hugging Face model directory.
    init_from: str | None = None
    # After training, also write a Hugging Face directory (transformers loads it) to <run dir>/hf.
    export_hf: bool = False


@dataclass
class EvalConfig:
    # A held-out corpus, in any form data.path takes (a .jsonl file's text in data.jsonl_field too;
    # tokenized into data.cache_dir alike), whose loss per token is measured without training on it:
    # every `every` steps and at the launch's last step (training.steps or training.stop_at; not at a
    # stop by a signal), logged as eval_loss beside that step's numbers. None: no evaluation.
    path: str | None = None
    # Evaluate every N optimizer steps; 0: only at the last step.
    every: int = 100
    # Batches of training.batch_size x training.seq_len tokens per data-parallel rank in each evaluation:
    # the same windows of the held-out corpus every time, drawn in an order that training.seed does not
    # change; fewer where the corpus holds fewer. None: the whole corpus (as many batches as it fills on
    # every rank).
    batches: int | None = 16


@dataclass
class LoggingConfig:
    # Log metrics every N optimizer steps (metrics.jsonl, a line in train.log and on the console).
    every: int = 10
    # A progress bar on the terminal (never drawn when stderr is not a terminal).
    progress_bar: bool = True
    # Also write the metrics as TensorBoard events to <run dir>/tensorboard (pip install -e '.[tensorboard]').
    tensorboard: bool = False
    # Trace steps profile_at .. profile_at + profile_steps - 1 with torch.profiler (the CPU's ops and, on
    # GPUs, every kernel): each rank writes <run dir>/profile/steps_<first>-<last>/rank<r>.json.gz, which
    # Perfetto (ui.perfetto.dev) or chrome://tracing opens. None: no trace.
    profile_at: int | None = None
    # Steps traced from profile_at (fewer where the launch ends sooner).
    profile_steps: int = 2


@dataclass
class TrainConfig:
    model: ModelArgs = MISSING
    parallel: ParallelConfig = MISSING
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # auto | cpu | cuda
    device: str = "auto"


@dataclass
class ServeConfig:
    model: ModelArgs = MISSING
    parallel: ParallelConfig = MISSING
    # bench: decode benchmark table; generate: print the completion of `prompt`.
    mode: str = "bench"
    # A weft checkpoint (step directory or run directory) or a Hugging Face model directory;
    # None: random weights of the model preset.
    checkpoint: str | None = None
    # generate: the text to complete, encoded as transformers' AutoTokenizer encodes it (its specials).
    prompt: str = "The Python language reference says"
    # generate: send `prompt` as one user message through the checkpoint's chat template (rendered as
    # transformers' apply_chat_template(..., add_generation_prompt=True) renders it).
    chat: bool = False
    # generate: a JSON file holding a list of {"role": ..., "content": ...} messages to send through the
    # chat template instead of `prompt` (implies chat=true).
    messages: str | None = None
    # generate: new tokens at most; decoding also stops at any end id of the checkpoint (tokenizer,
    # config.json and generation_config.json eos_token_id). Unset (null): the checkpoint's
    # generation_config.json max_new_tokens, else 64.
    max_new_tokens: int | None = None
    # Sampling (generate). Unset (null): the checkpoint's generation_config.json (its values when it sets
    # do_sample, transformers' defaults top_k=50, top_p=1 for those it leaves out), else greedy.
    # temperature 0 is greedy.
    temperature: float | None = None
    # Sample from the k most likely tokens (0: all).
    top_k: int | None = None
    # Then from the fewest most likely tokens whose probabilities sum to top_p, in (0, 1] (1: all).
    top_p: float | None = None
    # Benchmark: sequences decoded together, prompt tokens before decoding, decode steps timed.
    batch_size: int = 1
    prompt_len: int = 128
    decode_steps: int = 64
    # Capture the decode step in a CUDA graph (GPU only).
    cuda_graphs: bool = True
    # Fuse the decode step with torch.compile before capturing it.
    compile: bool = False
    # Weights and activations dtype: bfloat16 | float16 | float32.
    dtype: str = "bfloat16"
    # Seeds random weights and sampling: a run with the same seed samples the same completion.
    seed: int = 0
    device: str = "auto"


def register_configs() -> None:
    """Register the two top-level schemas (train.yaml and serve.yaml start from them). Their typed `model`
    and `parallel` fields type the presets merged into them, so the schemas stay out of the preset
    groups (where `model=model_schema` would be offered as a model)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="serve_schema", node=ServeConfig)


def register_resolvers() -> None:
    """`${weft_now:%Y-%m-%d_%H-%M-%S}` in run directory names: the launch time agreed by all ranks.
    `${weft_launch:${oc.select:hydra.job.num,""}}` names a launch's record: that time to the microsecond,
    and in a sweep the job's number, since every job of a sweep shares the launch time and jobs may
    share a run directory (hydra.sweep.subdir set to one name), where one record would overwrite, or a
    refused job remove, another's."""
    from omegaconf import OmegaConf

    from parallel.distributed import agreed_launch_time

    launch = agreed_launch_time()
    OmegaConf.register_new_resolver("weft_now", lambda pattern: launch.strftime(pattern), replace=True)

    def launch_name(job: object = "") -> str:
        name = launch.strftime("%Y-%m-%d_%H-%M-%S.%f")
        return name if job in ("", None) else f"{name}-job{job}"

    OmegaConf.register_new_resolver("weft_launch", launch_name, replace=True)
