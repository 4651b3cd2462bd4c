//! A fast encoder for byte-level BPE tokenizers: GPT-2 style (what [`crate::train_bpe`] writes,
//! and GPT-2's own) and Llama 3 / Qwen2 / Qwen3 style (a `Split` with their regex, then
//! `ByteLevel` without one, an NFC normalizer, added tokens). The same ids as the `tokenizers`
//! crate, several times faster on corpora: the pre-tokenising regex is scanned by hand, repeated
//! words are looked up in a per-thread cache that outlives a document, and NFC is skipped for
//! text that a quick check finds normalized already.
//!
//! Only tokenizers whose `tokenizer.json` has one of these shapes take this path: no normalizer
//! or NFC; a `ByteLevel` pre-tokenizer with the GPT-2 regex and no prefix space, or a `Sequence`
//! of a `Split` (Isolated, not inverted) with the GPT-2, cl100k/Llama 3 or Qwen2 regex and a
//! `ByteLevel` without regex or prefix space; a plain BPE model (no dropout, no subword prefix
//! or suffix, no byte fallback; `ignore_merges` is honoured); added tokens without lstrip,
//! rstrip or single_word. Anything else goes through the `tokenizers` crate. Tests compare both
//! on varied text.

use crate::tokenizer::PIECE_BYTES;
use rayon::prelude::*;
use serde_json::Value;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// GPT-2's pre-tokenising regex without its last-but-one alternative `\s+(?!\S)`, whose
/// look-ahead the `regex` crate lacks; [`FastBpe::for_each_word`] applies it by hand.
const SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// GPT-2's map from bytes to printable characters, as `ByteLevel` uses to spell tokens.
pub(crate) fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        map[b as usize] = if printable {
            b as char
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("valid char")
        };
    }
    map
}

/// GPT-2's pre-tokeniser (the split `ByteLevel` does with `use_regex`).
pub(crate) struct Pretokenizer {
    split: regex::Regex,
}

impl Pretokenizer {
    pub(crate) fn new() -> Self {
        Self {
            split: regex::Regex::new(SPLIT).expect("valid regex"),
        }
    }

    /// Call `f` on each pre-token of `text`, as GPT-2's regex splits it. The look-ahead
    /// alternative `\s+(?!\S)` makes a run of several whitespace characters followed by a
    /// non-space give up its last character, which then starts the next pre-token (" word").
    pub(crate) fn for_each_word<'a>(&self, text: &'a str, mut f: impl FnMut(&'a str)) {
        let mut pos = 0;
        while let Some(m) = self.split.find_at(text, pos) {
            let s = m.as_str();
            let mut end = m.end();
            if m.end() < text.len() && s.chars().all(char::is_whitespace) {
                if let Some((last, _)) = s.char_indices().nth(1).and(s.char_indices().last()) {
                    end = m.start() + last;
                }
            }
            f(&text[m.start()..end]);
            pos = end;
        }
    }
}

/// Which pre-tokenising regex a tokenizer uses; each is scanned by hand (see [`Scanner`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Style {
    /// GPT-2's: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// cl100k's family (Llama 3 with `max_digits` 3, Qwen2/Qwen3 with 1):
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
    Cl100k { max_digits: usize },
}

/// The `Split` regexes we scan by hand, as tokenizer.json files spell them.
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const CL100K_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const LETTER: u8 = 1;
const NUMBER: u8 = 2;
const SPACE: u8 = 4;

/// `\p{L}`, `\p{N}` and `\s` of every code point, from the same Unicode tables the `regex`
/// crate (and so the `tokenizers` crate's fancy-regex) matches with. 1.1 MB, built once.
fn classes() -> &'static [u8] {
    static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![0u8; 0x110000];
        for (pattern, bit) in [(r"\p{L}", LETTER), (r"\p{N}", NUMBER), (r"\s", SPACE)] {
            let hir = regex_syntax::parse(pattern).expect("valid class");
            let regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(c)) =
                hir.kind()
            else {
                unreachable!("{pattern} is a Unicode class")
            };
            for r in c.ranges() {
                for x in &mut t[r.start() as usize..=r.end() as usize] {
                    *x |= bit;
                }
            }
        }
        t
    })
}

/// A pre-tokeniser: finds where each pre-token ends, with the leftmost-first semantics of the
/// backtracking engines `tokenizers` uses, including the look-ahead `\s+(?!\S)`: a run of
/// several whitespace characters followed by a non-space gives up its last character, which
/// then starts the next pre-token.
struct Scanner<'a> {
    b: &'a [u8],
    class: &'static [u8],
}

impl Scanner<'_> {
    /// (class bits, char, byte length) of the character at byte `p` (a char boundary).
    #[inline]
    fn at(&self, p: usize) -> (u8, char, usize) {
        let b0 = self.b[p];
        if b0 < 0x80 {
            return (self.class[b0 as usize], b0 as char, 1);
        }
        let n = if b0 >= 0xF0 {
            4
        } else if b0 >= 0xE0 {
            3
        } else {
            2
        };
        // The bytes come from a &str, so this is one valid UTF-8 character.
        let c = std::str::from_utf8(&self.b[p..p + n])
            .ok()
            .and_then(|s| s.chars().next())
            .unwrap_or('\u{FFFD}');
        (self.class[c as usize], c, n)
    }

    #[inline]
    fn class_at(&self, p: usize) -> u8 {
        if p < self.b.len() {
            self.at(p).0
        } else {
            // End of text: belongs to no class (and is not a space).
            0x80
        }
    }

    /// End of the run of characters starting at `p` whose class, masked, equals `want`.
    #[inline]
    fn run(&self, mut p: usize, mask: u8, want: u8) -> usize {
        while p < self.b.len() {
            let (c, _, n) = self.at(p);
            if c & mask != want {
                break;
            }
            p += n;
        }
        p
    }

    /// `\s+(?!\S)|\s+` at `p` (a space): the run, less its last character when that is followed
    /// by a non-space and the run has more than one.
    fn spaces(&self, p: usize) -> usize {
        let (mut e, mut last, mut count) = (p, p, 0);
        while e < self.b.len() {
            let (c, _, n) = self.at(e);
            if c & SPACE == 0 {
                break;
            }
            last = e;
            e += n;
            count += 1;
        }
        if e < self.b.len() && count >= 2 {
            last
        } else {
            e
        }
    }

    fn next_gpt2(&self, p: usize) -> usize {
        let b = self.b;
        let (c, ch, _) = self.at(p);
        if ch == '\'' {
            let r = &b[p + 1..];
            for suffix in ["s", "t", "re", "ve", "m", "ll", "d"] {
                if r.starts_with(suffix.as_bytes()) {
                    return p + 1 + suffix.len();
                }
            }
        }
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run of one kind.
        let (q, cq) = if ch == ' ' && self.class_at(p + 1) & (SPACE | 0x80) == 0 {
            (p + 1, self.class_at(p + 1))
        } else {
            (p, c)
        };
        if cq & SPACE == 0 {
            let kind = cq & (LETTER | NUMBER);
            let kind = if kind & LETTER != 0 { LETTER } else { kind };
            return match kind {
                LETTER => self.run(q, LETTER, LETTER),
                NUMBER => self.run(q, NUMBER, NUMBER),
                _ => self.run(q, LETTER | NUMBER | SPACE, 0),
            };
        }
        self.spaces(p)
    }

    fn next_cl100k(&self, p: usize, max_digits: usize) -> usize {
        let b = self.b;
        let (c, ch, n) = self.at(p);
        if ch == '\'' && p + 1 < b.len() {
            // Case-insensitive as the regex engines fold: `s` also matches U+017F (long s).
            let r = &b[p + 1..];
            let is = |i: usize, want: u8| {
                r.get(i)
                    .is_some_and(|&x| x.is_ascii_alphabetic() && x | 0x20 == want)
            };
            if is(0, b's') || is(0, b't') || is(0, b'm') || is(0, b'd') {
                return p + 2;
            }
            if (is(0, b'r') || is(0, b'v')) && is(1, b'e') || is(0, b'l') && is(1, b'l') {
                return p + 3;
            }
            if r.starts_with("\u{17F}".as_bytes()) {
                return p + 3;
            }
        }
        // `[^\r\n\p{L}\p{N}]?\p{L}+`
        if c & LETTER != 0 {
            return self.run(p, LETTER, LETTER);
        }
        if ch != '\r' && ch != '\n' && c & NUMBER == 0 && self.class_at(p + n) & LETTER != 0 {
            return self.run(p + n, LETTER, LETTER);
        }
        // `\p{N}{1,max_digits}`
        if c & NUMBER != 0 {
            let mut e = p;
            for _ in 0..max_digits {
                if e >= b.len() {
                    break;
                }
                let (ce, _, ne) = self.at(e);
                if ce & NUMBER == 0 {
                    break;
                }
                e += ne;
            }
            return e;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let other = |cls: u8| cls & (LETTER | NUMBER | SPACE | 0x80) == 0;
        let q = if ch == ' ' && other(self.class_at(p + 1)) {
            p + 1
        } else {
            p
        };
        if other(self.class_at(q)) {
            let mut e = self.run(q, LETTER | NUMBER | SPACE, 0);
            while e < b.len() && (b[e] == b'\r' || b[e] == b'\n') {
                e += 1;
            }
            return e;
        }
        // `\s*[\r\n]+`: the spaces up to and including the run's last newline, if it has one.
        let (mut e, mut last_newline) = (p, None);
        while e < b.len() {
            let (ce, che, ne) = self.at(e);
            if ce & SPACE == 0 {
                break;
            }
            if che == '\r' || che == '\n' {
                last_newline = Some(e);
            }
            e += ne;
        }
        if let Some(q) = last_newline {
            return q + 1;
        }
        self.spaces(p)
    }
}

/// Call `f` on each pre-token of `text`.
fn for_each_pretoken<'a>(style: Style, text: &'a str, mut f: impl FnMut(&'a str)) {
    let s = Scanner {
        b: text.as_bytes(),
        class: classes(),
    };
    let mut p = 0;
    while p < text.len() {
        let e = match style {
            Style::Gpt2 => s.next_gpt2(p),
            Style::Cl100k { max_digits } => s.next_cl100k(p, max_digits),
        };
        debug_assert!(e > p && text.is_char_boundary(e));
        f(&text[p..e]);
        p = e;
    }
}

/// Added tokens, matched as the `tokenizers` crate does: leftmost-longest, first those not
/// `normalized` in the raw text, then those `normalized` in the normalized rest.
struct Added {
    raw: Option<(aho_corasick::AhoCorasick, Vec<u32>)>,
    normalized: Option<(aho_corasick::AhoCorasick, Vec<u32>)>,
}

fn trie(tokens: &[(String, u32)]) -> Option<(aho_corasick::AhoCorasick, Vec<u32>)> {
    if tokens.is_empty() {
        return None;
    }
    let ac = aho_corasick::AhoCorasick::builder()
        .match_kind(aho_corasick::MatchKind::LeftmostLongest)
        .build(tokens.iter().map(|t| &t.0))
        .ok()?;
    Some((ac, tokens.iter().map(|t| t.1).collect()))
}

/// A stretch of text between added tokens, or an added token's id.
enum Seg<'a> {
    Text(&'a str),
    Token(u32),
}

/// Split `text` at the matches of `trie`, in order; text stretches are never empty.
fn split_added<'a>(
    trie: Option<&(aho_corasick::AhoCorasick, Vec<u32>)>,
    text: &'a str,
    mut f: impl FnMut(Seg<'a>),
) {
    let Some((ac, ids)) = trie else {
        if !text.is_empty() {
            f(Seg::Text(text));
        }
        return;
    };
    let mut start = 0;
    for m in ac.find_iter(text) {
        if m.start() > start {
            f(Seg::Text(&text[start..m.start()]));
        }
        f(Seg::Token(ids[m.pattern().as_usize()]));
        start = m.end();
    }
    if start < text.len() {
        f(Seg::Text(&text[start..]));
    }
}

type FxMap<K, V> = HashMap<K, V, rustc_hash::FxBuildHasher>;

/// Words longer than this are not cached (rarely repeated).
const CACHE_WORD_BYTES: usize = 64;
/// A thread's cache is emptied when it holds this many words (a few tens of MB at most).
const CACHE_WORDS: usize = 200_000;

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// (owner's id, word bytes -> ids).
type WordCache = (u64, FxMap<Box<[u8]>, Box<[u32]>>);

thread_local! {
    /// Ids of words already encoded on this thread, kept across documents, for the tokenizer
    /// whose id is the first field (another tokenizer on the same thread starts afresh).
    static CACHE: std::cell::RefCell<WordCache> =
        std::cell::RefCell::new((0, FxMap::default()));
}

pub(crate) struct FastBpe {
    /// Tells this tokenizer's word cache from another's.
    id: u64,
    style: Style,
    /// Apply Unicode NFC before pre-tokenising.
    nfc: bool,
    added: Added,
    byte_id: [u32; 256],
    /// (left, right) -> (rank, merged id).
    merges: FxMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges`: words (as bytes) that are in the vocabulary whole.
    whole: Option<FxMap<Vec<u8>, u32>>,
}

impl FastBpe {
    /// The fast encoder for a `tokenizer.json`, or None if it has a shape we do not handle.
    pub(crate) fn from_json(json: &Value) -> Option<FastBpe> {
        let null_or = |v: &Value, ok: &dyn Fn(&Value) -> bool| v.is_null() || ok(v);
        let pre = &json["pre_tokenizer"];
        let model = &json["model"];
        let nfc = match &json["normalizer"] {
            Value::Null => false,
            n if n["type"] == "NFC" => true,
            _ => return None,
        };
        let byte_level_plain =
            |v: &Value| v["type"] == "ByteLevel" && v["add_prefix_space"] == false;
        let style = if byte_level_plain(pre) && pre["use_regex"] != false {
            Style::Gpt2
        } else if pre["type"] == "Sequence" {
            let seq = pre["pretokenizers"].as_array()?;
            let [split, bl] = seq.as_slice() else {
                return None;
            };
            if !(byte_level_plain(bl) && bl["use_regex"] == false)
                || split["type"] != "Split"
                || split["behavior"] != "Isolated"
                || split["invert"] != false
            {
                return None;
            }
            match split["pattern"]["Regex"].as_str()? {
                GPT2_REGEX => Style::Gpt2,
                QWEN2_REGEX => Style::Cl100k { max_digits: 1 },
                CL100K_REGEX => Style::Cl100k { max_digits: 3 },
                _ => return None,
            }
        } else {
            return None;
        };
        let plain_model = model["type"] == "BPE"
            && model["dropout"].is_null()
            && null_or(&model["continuing_subword_prefix"], &|v| v == "")
            && null_or(&model["end_of_word_suffix"], &|v| v == "")
            && model["byte_fallback"] != true;
        if !plain_model {
            return None;
        }
        let (mut raw, mut normalized) = (Vec::new(), Vec::new());
        for t in json["added_tokens"].as_array().map_or(&[][..], |a| a) {
            // lstrip, rstrip and single_word change matching; leave those to the crate.
            if t["lstrip"] == true || t["rstrip"] == true || t["single_word"] == true {
                return None;
            }
            let content = t["content"].as_str()?.to_string();
            let id = u32::try_from(t["id"].as_u64()?).ok()?;
            if t["normalized"] == true {
                // Matched against the normalized text, so normalized itself.
                let content = if nfc {
                    nfc_of(&content).into_owned()
                } else {
                    content
                };
                normalized.push((content, id));
            } else {
                raw.push((content, id));
            }
        }
        let added = Added {
            raw: trie(&raw),
            normalized: trie(&normalized),
        };
        if (!raw.is_empty() && added.raw.is_none())
            || (!normalized.is_empty() && added.normalized.is_none())
        {
            return None;
        }
        let vocab: HashMap<&str, u32> = model["vocab"]
            .as_object()?
            .iter()
            .map(|(k, v)| Some((k.as_str(), u32::try_from(v.as_u64()?).ok()?)))
            .collect::<Option<_>>()?;
        let chars = byte_to_char();
        let mut byte_id = [0u32; 256];
        for (b, c) in chars.iter().enumerate() {
            byte_id[b] = *vocab.get(c.to_string().as_str())?;
        }
        let mut merges = FxMap::default();
        for (rank, m) in model["merges"].as_array()?.iter().enumerate() {
            // Older files spell a merge "left right", newer ones ["left", "right"].
            let (l, r) = match m {
                Value::String(s) => s.split_once(' ')?,
                Value::Array(a) if a.len() == 2 => (a[0].as_str()?, a[1].as_str()?),
                _ => return None,
            };
            let merged = *vocab.get(format!("{l}{r}").as_str())?;
            let pair = (*vocab.get(l)?, *vocab.get(r)?);
            // A later spelling of the same pair replaces an earlier one, as the crate's map does.
            merges.insert(pair, (rank as u32, merged));
        }
        let whole = if model["ignore_merges"] == true {
            let mut back = [0u8; 0x200];
            for (b, c) in chars.iter().enumerate() {
                back[*c as usize] = b as u8;
            }
            let mut whole = FxMap::default();
            for (k, &id) in &vocab {
                // Keys outside the byte-level alphabet never match a pre-token's spelling.
                if k.chars()
                    .all(|c| (c as usize) < 0x200 && chars[back[c as usize] as usize] == c)
                {
                    whole.insert(k.chars().map(|c| back[c as usize]).collect(), id);
                }
            }
            Some(whole)
        } else {
            None
        };
        Some(FastBpe {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            style,
            nfc,
            added,
            byte_id,
            merges,
            whole,
        })
    }

    /// Apply merges to one pre-token: repeatedly merge the lowest-ranked adjacent pair, leftmost
    /// first, tracked with a heap of candidate pairs over a linked list of symbols.
    fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        if let Some(&id) = self.whole.as_ref().and_then(|w| w.get(word)) {
            out.push(id);
            return;
        }
        let n = word.len();
        let mut id: Vec<u32> = word.iter().map(|&b| self.byte_id[b as usize]).collect();
        if n == 1 {
            out.push(id[0]);
            return;
        }
        let mut next: Vec<usize> = (1..=n).collect(); // n = none
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect(); // MAX = none
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::with_capacity(n);
        let push = |heap: &mut BinaryHeap<_>, i: usize, l: u32, r: u32| {
            if let Some(&(rank, merged)) = self.merges.get(&(l, r)) {
                heap.push(Reverse((rank, i, merged)));
            }
        };
        for i in 0..n - 1 {
            push(&mut heap, i, id[i], id[i + 1]);
        }
        while let Some(Reverse((_, i, merged))) = heap.pop() {
            let j = next[i];
            // Skip entries made stale by earlier merges.
            if !alive[i] || j >= n || self.merges.get(&(id[i], id[j])).map(|m| m.1) != Some(merged)
            {
                continue;
            }
            id[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[j] < n {
                prev[next[j]] = i;
            }
            if prev[i] != usize::MAX {
                push(&mut heap, prev[i], id[prev[i]], id[i]);
            }
            if next[i] < n {
                push(&mut heap, i, id[i], id[next[i]]);
            }
        }
        let mut i = 0;
        while i < n {
            out.push(id[i]);
            i = next[i];
        }
    }

    /// Pre-tokenise and encode text that holds no added token, appending to `out`.
    fn encode_piece(&self, text: &str, out: &mut Vec<u32>) {
        CACHE.with(|c| {
            let mut c = c.borrow_mut();
            let (owner, cache) = &mut *c;
            if *owner != self.id || cache.len() >= CACHE_WORDS {
                *owner = self.id;
                cache.clear();
            }
            for_each_pretoken(self.style, text, |w| {
                let w = w.as_bytes();
                if let Some(ids) = cache.get(w) {
                    out.extend_from_slice(ids);
                } else {
                    let start = out.len();
                    self.encode_word(w, out);
                    if w.len() <= CACHE_WORD_BYTES {
                        cache.insert(w.into(), out[start..].into());
                    }
                }
            });
        });
    }

    /// Encode normalized text between raw added tokens.
    fn encode_normalized(&self, text: &str, out: &mut Vec<u32>) {
        split_added(self.added.normalized.as_ref(), text, |seg| match seg {
            Seg::Token(id) => out.push(id),
            Seg::Text(part) if part.len() <= PIECE_BYTES => self.encode_piece(part, out),
            Seg::Text(part) => {
                // Long text: pieces on the current rayon pool, in order.
                let encoded: Vec<Vec<u32>> = crate::tokenizer::pieces(part)
                    .par_iter()
                    .map(|p| {
                        let mut v = Vec::with_capacity(p.len() / 3);
                        self.encode_piece(p, &mut v);
                        v
                    })
                    .collect();
                for v in encoded {
                    out.extend_from_slice(&v);
                }
            }
        });
    }

    /// Ids of `text`, identical to the `tokenizers` crate's for the same `tokenizer.json`.
    pub(crate) fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3);
        split_added(self.added.raw.as_ref(), text, |seg| match seg {
            Seg::Token(id) => out.push(id),
            Seg::Text(part) if self.nfc => self.encode_normalized(&nfc_of(part), &mut out),
            Seg::Text(part) => self.encode_normalized(part, &mut out),
        });
        out
    }
}

/// Unicode NFC of `s`, as the `tokenizers` crate's `NFC` normalizer computes it (same crate and
/// tables); most text is NFC already, which a quick check sees without copying.
fn nfc_of(s: &str) -> std::borrow::Cow<'_, str> {
    use unicode_normalization_alignments::{is_nfc_quick, IsNormalized, UnicodeNormalization};
    if s.is_ascii() || is_nfc_quick(s.chars()) == IsNormalized::Yes {
        return std::borrow::Cow::Borrowed(s);
    }
    std::borrow::Cow::Owned(s.nfc().map(|(c, _)| c).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use crate::{builtin_corpus, train_bpe, HfTokenizer, Tokenizer};

    #[test]
    fn byte_map_is_the_byte_level_alphabet() {
        let ours: std::collections::HashSet<char> = byte_to_char().into_iter().collect();
        let theirs: std::collections::HashSet<char> =
            tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
                .into_iter()
                .collect();
        assert_eq!(ours.len(), 256);
        assert_eq!(ours, theirs);
        assert_eq!(byte_to_char()[b' ' as usize], 'Ġ');
        assert_eq!(byte_to_char()[b'\n' as usize], 'Ċ');
    }

    /// Text that exercises every branch of the pre-tokeniser: letters, digits, other symbols,
    /// contractions, runs of mixed whitespace, non-ASCII letters and spaces.
    fn random_text(rng: &mut SplitMix64, parts: usize) -> String {
        const ATOMS: &[&str] = &[
            "the", "cat", "a", "b", "s", " ", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "'",
            "'s", "'ll", "'re", "1", "23", "4567", ".", ",", "!?", "--", "é", "naïve", "東京",
            "🙂", "\u{a0}", "\u{3000}", "Ü", "x", "_", "(", ")", "\r\n",
        ];
        (0..parts)
            .map(|_| ATOMS[(rng.next_u64() % ATOMS.len() as u64) as usize])
            .collect()
    }

    fn trained() -> HfTokenizer {
        let mut rng = SplitMix64::new(11);
        let mut text = String::from_utf8(builtin_corpus(100_000, 5)).unwrap();
        for _ in 0..200 {
            text.push_str(&random_text(&mut rng, 100));
        }
        train_bpe([text], 900).unwrap()
    }

    #[test]
    fn fast_path_matches_the_tokenizers_crate() {
        let tk = trained();
        assert!(tk.is_fast());
        let mut rng = SplitMix64::new(99);
        for i in 0..400 {
            let text = random_text(&mut rng, 1 + i % 150);
            assert_eq!(
                tk.encode(&text),
                tk.encode_with_tokenizers_crate(&text).unwrap(),
                "{text:?}"
            );
        }
        // A long text, cut into pieces and encoded in parallel.
        let mut long = String::from_utf8(builtin_corpus(300_000, 8)).unwrap();
        long.push_str(&random_text(&mut rng, 5000));
        long.push_str(&" ".repeat(3000));
        let fast = tk.encode(&long);
        assert_eq!(fast, tk.encode_with_tokenizers_crate(&long).unwrap());
        assert_eq!(tk.decode(&fast), long);
    }

    #[test]
    fn other_shapes_fall_back_to_the_tokenizers_crate() {
        let tk = trained();
        let mut json: Value = serde_json::from_str(&tk.inner().to_string(false).unwrap()).unwrap();
        assert!(FastBpe::from_json(&json).is_some());
        json["pre_tokenizer"]["add_prefix_space"] = Value::Bool(true);
        assert!(FastBpe::from_json(&json).is_none());
        let dir = crate::test_util::TempDir::new("fallback");
        let p = dir.path().join("t.json");
        std::fs::write(&p, json.to_string()).unwrap();
        let slow = HfTokenizer::from_file(&p).unwrap();
        assert!(!slow.is_fast());
        // With a prefix space "cat" encodes as " cat" would without one.
        assert_eq!(slow.encode("cat sat"), tk.encode(" cat sat"));
    }

    /// Atoms for the Qwen/Llama-style tests: what their regex treats specially (case-folded
    /// contractions, digit runs, newlines inside space runs, punctuation before newlines),
    /// decomposed text that NFC changes, several scripts, emoji sequences, special tokens.
    const RICH: &[&str] = &[
        "the",
        "The",
        "cat",
        " ",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\r\n",
        " \n ",
        "\t",
        "\t\n",
        "'s",
        "'S",
        "'LL",
        "'Re",
        "'ve",
        "'M",
        "'d",
        "'x",
        "\u{17F}",
        "'\u{17F}",
        "'",
        "\"",
        "1",
        "12",
        "123",
        "1234567",
        "\u{664}\u{665}",
        "\u{b2}",
        ".",
        ",",
        "!?",
        "...\n",
        "(",
        ")",
        "--",
        "e\u{301}",
        "A\u{30A}",
        "\u{1100}\u{1161}",
        "\u{e9}",
        "na\u{ef}ve",
        "\u{3b1}\u{3b2}\u{3b3}",
        "\u{41f}\u{440}\u{438}\u{432}\u{435}\u{442}",
        "\u{645}\u{631}\u{62d}\u{628}\u{627}",
        "\u{939}\u{93f}\u{928}\u{94d}\u{926}\u{940}",
        "\u{e20}\u{e32}\u{e29}\u{e32}",
        "\u{6771}\u{4eac}",
        "\u{1f642}",
        "\u{1f469}\u{200d}\u{1f4bb}",
        "\u{1f44d}\u{1f3fd}",
        "\u{a0}",
        "\u{3000}",
        "\u{2028}",
        "\u{85}",
        "\u{feff}",
        "x",
        "_",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|im_",
        "|>",
        "<tool>",
        "\u{212b}",
    ];

    fn rich_text(rng: &mut SplitMix64, parts: usize) -> String {
        (0..parts)
            .map(|_| RICH[(rng.next_u64() % RICH.len() as u64) as usize])
            .collect()
    }

    /// The trained GPT-2-style tokenizer's model reshaped as `shape` ("qwen", "llama3",
    /// "gpt2-added" or "gpt2-split"), written to a file and loaded back.
    fn reshaped(shape: &str, dir: &crate::test_util::TempDir) -> HfTokenizer {
        let tk = trained();
        let mut json: Value = serde_json::from_str(&tk.inner().to_string(false).unwrap()).unwrap();
        let n = tk.vocab_size() as u64;
        let added = |content: &str, id: u64, normalized: bool| {
            serde_json::json!({"id": id, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": normalized, "special": true})
        };
        let split = |regex: &str| {
            serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
                 "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                 "use_regex": false}]})
        };
        match shape {
            "qwen" | "llama3" => {
                json["normalizer"] = serde_json::json!({"type": "NFC"});
                let (regex, eot) = if shape == "qwen" {
                    (QWEN2_REGEX, "<|endoftext|>")
                } else {
                    json["model"]["ignore_merges"] = Value::Bool(true);
                    (CL100K_REGEX, "<|end_of_text|>")
                };
                json["pre_tokenizer"] = split(regex);
                json["added_tokens"] = serde_json::json!([
                    added(eot, n, false),
                    added("<|im_start|>", n + 1, false),
                    added("<|im_end|>", n + 2, false),
                    // Matched after NFC: its decomposed spelling in the text must match too.
                    added("<tool>\u{212b}", n + 3, true),
                ]);
            }
            "gpt2-split" => {
                // GPT-2's regex spelled as a `Split`, as some converted files do.
                json["pre_tokenizer"] = split(GPT2_REGEX);
                json["added_tokens"] = serde_json::json!([added("<|endoftext|>", n, false)]);
            }
            "gpt2-added" => {
                // As GPT-2's own file: its end-of-text token is `normalized`.
                json["added_tokens"] = serde_json::json!([added("<|endoftext|>", n, true)]);
            }
            _ => unreachable!(),
        }
        let p = dir.path().join(format!("{shape}.json"));
        std::fs::write(&p, json.to_string()).unwrap();
        HfTokenizer::from_file(&p).unwrap()
    }

    fn assert_same_ids(tk: &HfTokenizer, text: &str) {
        assert_eq!(
            tk.encode(text),
            tk.encode_with_tokenizers_crate(text).unwrap(),
            "{text:?}"
        );
    }

    #[test]
    fn qwen_and_llama3_shapes_match_the_tokenizers_crate() {
        let dir = crate::test_util::TempDir::new("qwen-shape");
        for shape in ["qwen", "llama3", "gpt2-added", "gpt2-split"] {
            let tk = reshaped(shape, &dir);
            assert!(tk.is_fast(), "{shape}");
            let mut rng = SplitMix64::new(7);
            for i in 0..600 {
                assert_same_ids(&tk, &rich_text(&mut rng, 1 + i % 120));
            }
            // Text the regexes treat specially, spelled out so a failure names it.
            for text in [
                "",
                " ",
                "\n",
                "  \n  x",
                "\n\n  x",
                " \r\n\r\n y",
                "a  \t b",
                "x   ",
                "I'M HERE, YOU'LL SEE, WE'RE 'S'",
                "it'\u{17F} 'Ss",
                "'\u{17F}x'\u{17F}\u{17F}",
                "12345678 1.5e10",
                "e\u{301}t\u{e9}",
                "<|im_start|>user\nhi<|im_end|>\n",
                "<|endoftext|><|endoftext|>",
                "a<tool>A\u{30A}b<tool>\u{212b}",
                "((hello)) \"quote\" ...\n\nnext",
                "\u{1f469}\u{200d}\u{1f4bb} \u{1f44d}\u{1f3fd}!",
                "\u{3000}\u{3000}\u{6771}",
            ] {
                assert_same_ids(&tk, text);
            }
            // Long text: pieces in parallel; special tokens and decomposed letters throughout.
            let mut long = String::from_utf8(builtin_corpus(200_000, 3)).unwrap();
            long.push_str(&rich_text(&mut rng, 20_000));
            assert_same_ids(&tk, &long);
            // Invalid UTF-8 becomes U+FFFD before encoding, as on the crate's path.
            let bytes = b"ok \xff\xfe caf\xc3\xa9 \xe6\x9d<|im_end|>\xf0\x9f";
            assert_eq!(
                tk.encode_bytes(bytes).unwrap(),
                tk.encode_with_tokenizers_crate(&String::from_utf8_lossy(bytes))
                    .unwrap()
            );
        }
        // The special tokens really come out as their ids.
        let tk = reshaped("qwen", &dir);
        let n = trained().vocab_size() as u32;
        let ids = tk.encode("<|im_start|>x<|im_end|><tool>A\u{30A}");
        assert_eq!(ids[0], n + 1);
        assert_eq!(&ids[ids.len() - 2..], &[n + 2, n + 3]);
    }

    #[test]
    fn unhandled_shapes_of_the_split_family_fall_back() {
        let dir = crate::test_util::TempDir::new("qwen-fallback");
        let tk = reshaped("qwen", &dir);
        let base: Value = serde_json::from_str(&tk.inner().to_string(false).unwrap()).unwrap();
        assert!(FastBpe::from_json(&base).is_some());
        type Edit = (&'static str, fn(&mut Value));
        let edits: [Edit; 4] = [
            ("another regex", |j| {
                j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+|\\S+".into()
            }),
            ("lstrip", |j| j["added_tokens"][0]["lstrip"] = true.into()),
            ("NFKC", |j| j["normalizer"]["type"] = "NFKC".into()),
            ("prefix space", |j| {
                j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true.into()
            }),
        ];
        for (what, edit) in edits {
            let mut j = base.clone();
            edit(&mut j);
            assert!(FastBpe::from_json(&j).is_none(), "{what}");
        }
    }

    /// The pre-tokens themselves, against the crate's pre-tokenizer on the same text: a wrong
    /// split shows here even where the merges would hide it in the ids.
    #[test]
    fn pretokens_match_the_tokenizers_crate() {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let dir = crate::test_util::TempDir::new("pretokens");
        let mut rng = SplitMix64::new(5);
        let mut tokenizers = vec![trained()];
        tokenizers.extend(["gpt2-split", "qwen", "llama3"].map(|s| reshaped(s, &dir)));
        for tk in tokenizers {
            let json: Value = serde_json::from_str(&tk.inner().to_string(false).unwrap()).unwrap();
            let style = FastBpe::from_json(&json).unwrap().style;
            let pre = tk.inner().get_pre_tokenizer().unwrap();
            for i in 0..1500 {
                let text = rich_text(&mut rng, 1 + i % 60);
                let mut pts = PreTokenizedString::from(text.as_str());
                pre.pre_tokenize(&mut pts).unwrap();
                let theirs: Vec<(usize, usize)> = pts
                    .get_splits(OffsetReferential::Original, OffsetType::Byte)
                    .into_iter()
                    .map(|(_, o, _)| o)
                    .collect();
                let mut ours = Vec::new();
                for_each_pretoken(style, &text, |w| {
                    let start = w.as_ptr() as usize - text.as_ptr() as usize;
                    ours.push((start, start + w.len()));
                });
                assert_eq!(ours, theirs, "{style:?} {text:?}");
            }
        }
    }
}
