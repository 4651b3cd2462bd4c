"""Helper for bench/tokenize_vs_hf.sh: builds the corpus and the two tokenizers, times the
`tokenizers` package and `ganymede data prepare` side by side on one core, checks the ids match.

  corpus OUT.jsonl MB            real text found on this machine, one JSON document a line
  train CORPUS STYLE VOCAB OUT   STYLE gpt2 or qwen: a tokenizer.json trained by `tokenizers`
  bench GANYMEDE CORPUS TOK REPS time both sides (round-robin), compare ids, print the rows
"""

import gzip
import json
import os
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Qwen2's pre-tokenising regex, as its tokenizer.json spells it.
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def mo_strings(path):
    """Translated strings of a gettext .mo catalogue (our own reader: no gettext charset games)."""
    data = Path(path).read_bytes()
    if len(data) < 28:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    end = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if end is None:
        return []
    n, _, trans_off = struct.unpack(end + "III", data[8:20])
    out = []
    for i in range(n):
        length, off = struct.unpack(end + "II", data[trans_off + 8 * i : trans_off + 8 * i + 8])
        s = data[off : off + length]
        if i == 0 or not s:  # entry 0 is the catalogue's header
            continue
        try:
            out.append(s.decode("utf-8").replace("\x00", "\n"))
        except UnicodeDecodeError:
            pass
    return out


def chunks(text, size):
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= size:
            out.append("".join(cur))
            cur, n = [], 0
    if cur:
        out.append("".join(cur))
    return out


def corpus(out, mb):
    limit = int(mb * 1e6)
    docs = []
    for p in sorted(Path("/usr/share/common-licenses").glob("*")):
        if p.is_file():
            docs.append(("license", p.read_text(errors="replace")))
    for p in sorted(Path("/usr/share/doc").glob("*/copyright")):
        docs.append(("copyright", p.read_text(errors="replace")))
    for p in sorted(Path("/usr/share/doc").glob("*/changelog*.gz")):
        try:
            docs.append(("changelog", gzip.open(p).read().decode("utf-8", errors="replace")))
        except OSError:
            pass
    # Translations: one document per catalogue (messages joined by newlines), many languages.
    mos = sorted(Path("/").glob("usr/share/locale/*/LC_MESSAGES/*.mo"))
    mos += sorted(Path("/usr/share/vim").glob("*/lang/*/LC_MESSAGES/*.mo"))
    for p in mos:
        s = mo_strings(p)
        if s:
            docs.append(("translation", "\n".join(s)))
    # Web-sized documents: long texts cut at line ends into pieces of about 4 KB.
    docs = [(kind, piece) for kind, text in docs for piece in chunks(text, 4000)]
    rng = random.Random(33)
    rng.shuffle(docs)
    total, kinds, n = 0, {}, 0
    with open(out, "w", encoding="utf-8") as f:
        for kind, text in docs:
            if total >= limit:
                break
            b = len(text.encode("utf-8"))
            total += b
            kinds[kind] = kinds.get(kind, 0) + b
            n += 1
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    langs = {p.parts[4] if p.parts[3] == "locale" else p.parts[5] for p in mos}
    print(
        f"corpus: {n} documents, {total / 1e6:.1f} MB ("
        + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(kinds.items()))
        + f"); translations from {len(mos)} catalogues in {len(langs)} locales"
    )


def read_docs(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train(corpus_path, style, vocab, out):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    tk = Tokenizer(models.BPE())
    if style == "gpt2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        specials = ["<|endoftext|>"]
    elif style == "qwen":
        tk.normalizer = normalizers.NFC()
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        specials = QWEN_SPECIALS
    else:
        sys.exit(f"unknown style {style}")
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
    )
    docs = read_docs(corpus_path)
    t0 = time.time()
    tk.train_from_iterator(docs, trainer=trainer)
    tk.save(out)
    print(f"trained {style}: vocabulary {tk.get_vocab_size()} in {time.time() - t0:.0f} s -> {out}")


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def hf_run(docs, tok_path, method, eod):
    """One timed encode of every document on one core; returns (seconds, cpu seconds, ids)."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(tok_path)
    fn = tk.encode_batch_fast if method == "encode_batch_fast" else tk.encode_batch
    c0, t0 = time.process_time(), time.perf_counter()
    encs = fn(docs, add_special_tokens=False)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    ids = []
    for e in encs:
        ids.extend(e.ids)
        if eod is not None:
            ids.append(eod)
    return secs, cpu, ids


def shard_ids(folder):
    """Every id in a prepared folder's shards, in order (format: crates/data/src/shards.rs)."""
    ids = []
    for p in sorted(Path(folder).rglob("*.gtok")):
        b = p.read_bytes()
        assert b[:8] == b"GNYMTOK\0", p
        width, tokens = struct.unpack("<IQ", b[12:24])
        eod = struct.unpack("<Q", b[40:48])[0]
        fmt = {2: "H", 4: "I"}[width]
        ids.extend(struct.unpack(f"<{tokens}{fmt}", b[64 : 64 + width * tokens]))
    return ids, (None if eod == 2**64 - 1 else eod)


def ganymede_run(binary, corpus_path, tok_path, out):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [binary, "data", "prepare", corpus_path, "--tokenizer", tok_path, "--workers", "1",
           "--eod", "auto", "--out", out, "--quiet"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t0
    stdout, stderr = p.stdout.read().decode(), p.stderr.read().decode()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{stdout}{stderr}")
    return secs, ru.ru_utime + ru.ru_stime, stdout


def bench(binary, corpus_path, tok_path, reps):
    docs = read_docs(corpus_path)
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    out = tempfile.mkdtemp(prefix="tokbench-")
    name = Path(tok_path).stem
    times = {"ganymede data prepare": [], "encode_batch_fast": [], "encode_batch": []}
    cpu = {k: [] for k in times}
    ours_ids, hf_ids, last_stdout = None, None, ""
    for r in range(reps):
        s, c, last_stdout = ganymede_run(binary, corpus_path, tok_path, out + "/prep")
        times["ganymede data prepare"].append(s)
        cpu["ganymede data prepare"].append(c)
        if ours_ids is None:
            ours_ids, eod = shard_ids(out + "/prep")
        for m in ("encode_batch_fast", "encode_batch"):
            s, c, ids = hf_run(docs, tok_path, m, eod)
            times[m].append(s)
            cpu[m].append(c)
            if hf_ids is None:
                hf_ids = ids
            elif ids != hf_ids:
                sys.exit(f"{name}: encode_batch and encode_batch_fast disagree")
        print(f"  {name} rep {r + 1}/{reps}: " + ", ".join(
            f"{k} {v[-1]:.2f} s" for k, v in times.items()), file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    if ours_ids != hf_ids:
        first = next((i for i, (a, b) in enumerate(zip(ours_ids, hf_ids)) if a != b),
                     min(len(ours_ids), len(hf_ids)))
        sys.exit(f"{name}: ids DIFFER: ganymede {len(ours_ids)} ids, tokenizers {len(hf_ids)}; "
                 f"first difference at id {first}: {ours_ids[first:first + 8]} vs "
                 f"{hf_ids[first:first + 8]}")
    tokens = len(hf_ids)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{name}: {len(docs)} documents, {mb:.1f} MB, {tokens} tokens (with end-of-document "
          f"ids {eod}); ids identical: yes")
    print(f"  {'':24} {'median s':>9} {'MB/s':>7} {'tokens/s':>10} {'cpu/wall':>8} {'ganymede x':>10}")
    g = med["ganymede data prepare"]
    for k, s in med.items():
        util = statistics.median(c / w for c, w in zip(cpu[k], times[k]))
        print(f"  {k:24} {s:9.2f} {mb / s:7.2f} {tokens / s:10.0f} {util:8.2f} {s / g:10.2f}")
    print(f"  ({reps} repetitions; ganymede's time is the whole process: start, tokenizer load, "
          f"JSONL read, shards written; the package's is the encode call on documents in memory)")


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    a = sys.argv[2:]
    if cmd == "corpus":
        corpus(a[0], float(a[1]))
    elif cmd == "train":
        train(a[0], a[1], int(a[2]), a[3])
    elif cmd == "bench":
        print(f"CPU: {cpu_name()}; one core each: ganymede --workers 1, the package with "
              f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS')} "
              f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM')}")
        import tokenizers

        print(f"tokenizers package {tokenizers.__version__}")
        bench(a[0], a[1], a[2], int(a[3]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
