//! A fast encoder for GPT-2-style byte-level BPE tokenizers (what [`crate::train_bpe`] writes,
//! and GPT-2's own): the same ids as the `tokenizers` crate, several times faster on corpora,
//! because repeated words are looked up in a cache instead of going through the general pipeline
//! (which allocates per split).
//!
//! Only tokenizers whose `tokenizer.json` has exactly this shape take this path: no normalizer,
//! a `ByteLevel` pre-tokenizer with the GPT-2 regex and no prefix space, a plain BPE model (no
//! dropout, no subword prefix or suffix, no byte fallback), no added tokens. Anything else goes
//! through the `tokenizers` crate. Tests compare both on varied text.

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

pub(crate) struct FastBpe {
    pre: Pretokenizer,
    byte_id: [u32; 256],
    /// (left, right) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
}

impl FastBpe {
    /// The fast encoder for a `tokenizer.json`, or None if it is not plain GPT-2-style BPE.
    pub(crate) fn from_json(json: &Value) -> Option<FastBpe> {
        let null_or = |v: &Value, ok: &dyn Fn(&Value) -> bool| v.is_null() || ok(v);
        let pre = &json["pre_tokenizer"];
        let model = &json["model"];
        let plain = json["normalizer"].is_null()
            && json["added_tokens"].as_array().is_none_or(|a| a.is_empty())
            && pre["type"] == "ByteLevel"
            && pre["add_prefix_space"] == false
            && pre["use_regex"] != false
            && model["type"] == "BPE"
            && model["dropout"].is_null()
            && null_or(&model["continuing_subword_prefix"], &|v| v == "")
            && null_or(&model["end_of_word_suffix"], &|v| v == "")
            && model["byte_fallback"] != true
            && model["ignore_merges"] != true;
        if !plain {
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
        let mut merges = HashMap::new();
        for (rank, m) in model["merges"].as_array()?.iter().enumerate() {
            // Older files spell a merge "left right", newer ones ["left", "right"].
            let (l, r) = match m {
                Value::String(s) => s.split_once(' ')?,
                Value::Array(a) if a.len() == 2 => (a[0].as_str()?, a[1].as_str()?),
                _ => return None,
            };
            let merged = *vocab.get(format!("{l}{r}").as_str())?;
            let pair = (*vocab.get(l)?, *vocab.get(r)?);
            // The first (lowest-rank) spelling of a pair wins, as in the tokenizers crate.
            merges.entry(pair).or_insert((rank as u32, merged));
        }
        Some(FastBpe {
            pre: Pretokenizer::new(),
            byte_id,
            merges,
        })
    }

    /// Apply merges to one pre-token: repeatedly merge the lowest-ranked adjacent pair, leftmost
    /// first, tracked with a heap of candidate pairs over a linked list of symbols.
    fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        let n = word.len();
        let mut id: Vec<u32> = word.iter().map(|&b| self.byte_id[b as usize]).collect();
        if n == 1 {
            out.push(id[0]);
            return;
        }
        let mut next: Vec<usize> = (1..=n).collect(); // n = none
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect(); // MAX = none
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
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

    fn encode_piece<'a>(&self, text: &'a str, cache: &mut HashMap<&'a str, Vec<u32>>) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3);
        self.pre.for_each_word(text, |w| {
            if let Some(ids) = cache.get(w) {
                out.extend_from_slice(ids);
            } else {
                let start = out.len();
                self.encode_word(w.as_bytes(), &mut out);
                // Long words are rarely repeated; keep the cache small.
                if w.len() <= 64 {
                    cache.insert(w, out[start..].to_vec());
                }
            }
        });
        out
    }

    /// Ids of `text`, identical to the `tokenizers` crate's for the same `tokenizer.json`.
    pub(crate) fn encode(&self, text: &str) -> Vec<u32> {
        let parts = crate::tokenizer::pieces(text);
        let encoded: Vec<Vec<u32>> = parts
            .par_iter()
            .map_init(HashMap::new, |cache, p| self.encode_piece(p, cache))
            .collect();
        encoded.concat()
    }
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
}
