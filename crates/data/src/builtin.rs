//! The built-in corpus: English-like sentences from a small probabilistic grammar whose entropy
//! rate is known exactly.
//!
//! The grammar is a *unifilar* probabilistic automaton: each state emits one "word" (a fixed byte
//! string such as `"cat "` or `"garden.\n"`) with a fixed probability, and the next state is a
//! function of the state and the emitted word. Every word is letters followed by a terminator
//! that ends in exactly one whitespace byte (`" "`, `", "`, `". "`, `".\n"`), so the words of a
//! state form a prefix-free code and the byte stream parses back into words, and states, uniquely.
//! The byte sequence therefore carries exactly the information of the word sequence, and
//!
//! ```text
//!   entropy per byte = sum_s pi(s) H(word | s) / sum_s pi(s) E[len(word) | s]
//! ```
//!
//! with `pi` the stationary distribution of the state chain (renewal-reward: bits per word over
//! bytes per word). Nothing here is estimated; the test checks it against the mean `-log p` of
//! generated text parsed back under the true model.

use crate::rng::SplitMix64;
#[cfg(test)]
use std::collections::HashMap;
use std::collections::HashSet;
use std::sync::OnceLock;

/// Seed of the built-in corpus when the data config does not name one: the corpus is fixed, so
/// runs with different training seeds see the same text.
pub const BUILTIN_SEED: u64 = 0x5EED_0000_6A1A_C7E5;

struct Emission {
    bytes: Vec<u8>,
    prob: f64,
    next: usize,
}

struct State {
    emissions: Vec<Emission>,
    /// Cumulative probabilities for sampling by binary search.
    cumulative: Vec<f64>,
}

/// The grammar as an automaton.
pub(crate) struct Grammar {
    states: Vec<State>,
    start: usize,
}

// Word lists, most frequent first (weights are Zipf-like by rank). Every noun and adjective starts
// with a consonant so that "a" reads naturally before them.
const DETS: &[&str] = &[
    "the", "a", "this", "my", "every", "that", "our", "her", "his",
];
const NAMES: &[&str] = &[
    "Alice", "Bob", "Clara", "David", "Emma", "Frank", "Grace", "Henry",
];
const AGENTS: &[&str] = &[
    "cat", "dog", "girl", "boy", "teacher", "farmer", "bird", "king", "queen", "child", "doctor",
    "fox", "horse", "sailor", "baker", "miner", "crow", "mouse", "poet", "judge", "wolf", "nurse",
    "pilot", "tiger",
];
const THINGS: &[&str] = &[
    "ball", "book", "pear", "letter", "song", "stone", "bread", "lamp", "coat", "map", "key",
    "box", "ring", "flower", "cup", "chair", "boat", "story", "picture", "bell", "rope", "hat",
    "door", "basket",
];
const PLACES: &[&str] = &[
    "garden", "house", "forest", "market", "village", "kitchen", "library", "harbor", "field",
    "city", "school", "tower",
];
const ADJS: &[&str] = &[
    "big", "small", "red", "green", "quiet", "happy", "tired", "clever", "brave", "gentle",
    "little", "bright", "dark", "heavy", "warm", "cold", "strange", "golden", "silver", "proud",
];
const TRANSITIVE: &[&str] = &[
    "sees", "finds", "likes", "carries", "paints", "reads", "wants", "holds", "brings", "opens",
    "follows", "watches", "builds", "keeps", "loses", "sells",
];
const INTRANSITIVE: &[&str] = &[
    "sleeps", "runs", "waits", "sings", "laughs", "walks", "dreams", "smiles", "works", "falls",
];
const ADVERBS: &[&str] = &[
    "quietly", "slowly", "today", "again", "often", "early", "there", "alone",
];
const PREPS: &[&str] = &["in", "near", "behind", "under", "beside", "across"];
const CONJS: &[&str] = &["and", "but", "so", "while", "because"];

// States of the grammar.
const START: usize = 0; // sentence start: capitalised
const CLAUSE: usize = 1; // clause after a conjunction: lower case
const SUBJ_DET: usize = 2; // after a subject's determiner
const SUBJ_ADJ: usize = 3; // after a subject's adjective
const VERB: usize = 4; // subject done, verb next
const OBJ: usize = 5; // after a transitive verb
const OBJ_DET: usize = 6;
const OBJ_ADJ: usize = 7;
const TAIL: usize = 8; // optional adverb or prepositional phrase
const PREP_DET: usize = 9; // after a preposition
const PLACE: usize = 10; // after the preposition's determiner
const CONJ: usize = 11; // after ", "
const NUM_STATES: usize = 12;

/// Zipf-like weights 1/(rank+1), normalised.
fn zipf(n: usize) -> Vec<f64> {
    let w: Vec<f64> = (0..n).map(|r| 1.0 / (r as f64 + 1.0)).collect();
    let s: f64 = w.iter().sum();
    w.into_iter().map(|x| x / s).collect()
}

fn capitalise(w: &str) -> String {
    let mut c = w.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// One part of a state's distribution: a word class with a probability, and how the word ends.
struct Part<'a> {
    prob: f64,
    words: &'a [&'a str],
    capital: bool,
    /// (terminator, probability, next state); the probabilities sum to one.
    ends: Vec<(&'a str, f64, usize)>,
}

/// How a sentence may end after its last word: go on with a tail, a new clause, or a new sentence
/// (sometimes a new paragraph).
const AFTER_OBJECT: &[(&str, f64, usize)] = &[
    (" ", 0.30, TAIL),
    (". ", 0.45, START),
    (", ", 0.15, CONJ),
    (".\n", 0.10, START),
];
const AFTER_INTRANSITIVE: &[(&str, f64, usize)] = &[
    (" ", 0.50, TAIL),
    (". ", 0.30, START),
    (", ", 0.10, CONJ),
    (".\n", 0.10, START),
];
const FINAL: &[(&str, f64, usize)] = &[
    (". ", 0.70, START),
    (", ", 0.15, CONJ),
    (".\n", 0.15, START),
];

impl Grammar {
    fn build() -> Grammar {
        // A plain space and a fixed next state.
        let to = |next: usize| vec![(" ", 1.0, next)];
        let part = |prob, words, capital, ends: Vec<_>| Part {
            prob,
            words,
            capital,
            ends,
        };
        let spec: [Vec<Part>; NUM_STATES] = [
            // START
            vec![
                part(0.75, DETS, true, to(SUBJ_DET)),
                part(0.25, NAMES, false, to(VERB)),
            ],
            // CLAUSE
            vec![
                part(0.75, DETS, false, to(SUBJ_DET)),
                part(0.25, NAMES, false, to(VERB)),
            ],
            // SUBJ_DET
            vec![
                part(0.30, ADJS, false, to(SUBJ_ADJ)),
                part(0.70, AGENTS, false, to(VERB)),
            ],
            // SUBJ_ADJ
            vec![
                part(0.10, ADJS, false, to(SUBJ_ADJ)),
                part(0.90, AGENTS, false, to(VERB)),
            ],
            // VERB
            vec![
                part(0.60, TRANSITIVE, false, to(OBJ)),
                part(0.40, INTRANSITIVE, false, AFTER_INTRANSITIVE.to_vec()),
            ],
            // OBJ
            vec![
                part(0.80, DETS, false, to(OBJ_DET)),
                part(0.20, NAMES, false, AFTER_OBJECT.to_vec()),
            ],
            // OBJ_DET
            vec![
                part(0.30, ADJS, false, to(OBJ_ADJ)),
                part(0.70, THINGS, false, AFTER_OBJECT.to_vec()),
            ],
            // OBJ_ADJ
            vec![
                part(0.10, ADJS, false, to(OBJ_ADJ)),
                part(0.90, THINGS, false, AFTER_OBJECT.to_vec()),
            ],
            // TAIL
            vec![
                part(0.40, ADVERBS, false, FINAL.to_vec()),
                part(0.60, PREPS, false, to(PREP_DET)),
            ],
            // PREP_DET
            vec![part(1.0, DETS, false, to(PLACE))],
            // PLACE
            vec![part(1.0, PLACES, false, FINAL.to_vec())],
            // CONJ
            vec![part(1.0, CONJS, false, to(CLAUSE))],
        ];

        let mut states = Vec::with_capacity(NUM_STATES);
        let mut seen = HashSet::new();
        for (s, parts) in spec.iter().enumerate() {
            let mut emissions = Vec::new();
            for p in parts {
                for (w, pw) in p.words.iter().zip(zipf(p.words.len())) {
                    let word = if p.capital {
                        capitalise(w)
                    } else {
                        (*w).to_string()
                    };
                    for &(end, pe, next) in &p.ends {
                        let bytes = format!("{word}{end}").into_bytes();
                        let prob = p.prob * pw * pe;
                        let fresh = seen.insert((s, bytes.clone()));
                        assert!(fresh, "state {s} emits {word:?}{end:?} twice");
                        emissions.push(Emission { bytes, prob, next });
                    }
                }
            }
            let mut acc = 0.0;
            let cumulative = emissions
                .iter()
                .map(|e| {
                    acc += e.prob;
                    acc
                })
                .collect();
            states.push(State {
                emissions,
                cumulative,
            });
        }
        Grammar {
            states,
            start: START,
        }
    }

    pub(crate) fn get() -> &'static Grammar {
        static G: OnceLock<Grammar> = OnceLock::new();
        G.get_or_init(Grammar::build)
    }

    /// Stationary distribution of the state chain. Lazy power iteration (`pi <- (pi + pi T) / 2`)
    /// converges whatever the chain's period; the result is exact to f64 rounding.
    fn stationary(&self) -> Vec<f64> {
        let n = self.states.len();
        let mut pi = vec![1.0 / n as f64; n];
        for _ in 0..1_000_000 {
            let mut next = vec![0.0; n];
            for (s, st) in self.states.iter().enumerate() {
                for e in &st.emissions {
                    next[e.next] += pi[s] * e.prob;
                }
            }
            let mut diff = 0.0;
            for s in 0..n {
                let v = 0.5 * (pi[s] + next[s]);
                diff += (v - pi[s]).abs();
                pi[s] = v;
            }
            if diff < 1e-16 {
                break;
            }
        }
        let total: f64 = pi.iter().sum();
        pi.iter().map(|p| p / total).collect()
    }

    /// (entropy per word in nats, mean bytes per word), both under the stationary distribution.
    pub(crate) fn word_stats(&self) -> (f64, f64) {
        let pi = self.stationary();
        let mut h = 0.0;
        let mut len = 0.0;
        for (s, st) in self.states.iter().enumerate() {
            for e in &st.emissions {
                h -= pi[s] * e.prob * e.prob.ln();
                len += pi[s] * e.prob * e.bytes.len() as f64;
            }
        }
        (h, len)
    }

    fn generate(&self, bytes: usize, seed: u64) -> Vec<u8> {
        let mut rng = SplitMix64::new(seed);
        let mut out = Vec::with_capacity(bytes + 32);
        let mut s = self.start;
        while out.len() < bytes {
            let st = &self.states[s];
            let u = rng.next_f64() * st.cumulative[st.cumulative.len() - 1];
            let i = st
                .cumulative
                .partition_point(|&c| c <= u)
                .min(st.emissions.len() - 1);
            let e = &st.emissions[i];
            out.extend_from_slice(&e.bytes);
            s = e.next;
        }
        out.truncate(bytes);
        out
    }

    /// Parse text from the start state and return (sum of -ln p over whole words, bytes they
    /// cover). A final partial word is ignored; an unparsable word is an error.
    #[cfg(test)]
    pub(crate) fn neg_log_prob(&self, text: &[u8]) -> Result<(f64, usize), String> {
        let lookup: HashMap<(usize, &[u8]), (f64, usize)> = self
            .states
            .iter()
            .enumerate()
            .flat_map(|(s, st)| {
                st.emissions
                    .iter()
                    .map(move |e| ((s, &e.bytes[..]), (e.prob, e.next)))
            })
            .collect();
        let mut s = self.start;
        let mut nll = 0.0;
        let mut pos = 0;
        while let Some(end) = text[pos..].iter().position(|&b| b == b' ' || b == b'\n') {
            let word = &text[pos..pos + end + 1];
            let &(p, next) = lookup.get(&(s, word)).ok_or_else(|| {
                format!(
                    "byte {pos}: {:?} cannot follow in state {s}",
                    String::from_utf8_lossy(word)
                )
            })?;
            nll -= p.ln();
            s = next;
            pos += end + 1;
        }
        Ok((nll, pos))
    }
}

/// `bytes` bytes of the built-in corpus generated from `seed` (deterministic; a prefix of a longer
/// corpus with the same seed).
pub fn builtin_corpus(bytes: usize, seed: u64) -> Vec<u8> {
    Grammar::get().generate(bytes, seed)
}

/// The entropy rate of the built-in corpus in nats per byte: the floor of the cross-entropy any
/// byte-level model can reach on it.
pub fn builtin_entropy_nats_per_byte() -> f64 {
    let (h, len) = Grammar::get().word_stats();
    h / len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_sum_to_one_and_words_are_prefix_free() {
        let g = Grammar::get();
        for (s, st) in g.states.iter().enumerate() {
            let total: f64 = st.emissions.iter().map(|e| e.prob).sum();
            assert!((total - 1.0).abs() < 1e-12, "state {s} sums to {total}");
            for e in &st.emissions {
                // Exactly one whitespace byte, at the end: what makes the parse unique.
                let ws = e.bytes.iter().filter(|b| b.is_ascii_whitespace()).count();
                assert_eq!(ws, 1, "{:?}", String::from_utf8_lossy(&e.bytes));
                assert!(e.bytes.last().unwrap().is_ascii_whitespace());
            }
        }
    }

    #[test]
    fn entropy_matches_the_empirical_cross_entropy_of_generated_text() {
        let floor = builtin_entropy_nats_per_byte();
        let text = builtin_corpus(2 << 20, 7);
        let (nll, covered) = Grammar::get().neg_log_prob(&text).unwrap();
        assert!(covered > text.len() - 64);
        let empirical = nll / covered as f64;
        // 2 MiB holds ~300k words; the standard error of the mean is well under 0.5%.
        let rel = (empirical - floor).abs() / floor;
        assert!(
            rel < 0.01,
            "closed form {floor:.5} vs empirical {empirical:.5} nats/byte"
        );
        // A sanity range: English-like text of this grammar sits far below log(256) = 5.55.
        assert!(floor > 0.2 && floor < 1.5, "{floor}");
    }

    #[test]
    fn corpus_is_deterministic_exact_length_and_readable() {
        let a = builtin_corpus(100_000, 1);
        assert_eq!(a.len(), 100_000);
        assert_eq!(a, builtin_corpus(100_000, 1));
        assert_ne!(a, builtin_corpus(100_000, 2));
        assert_eq!(&a[..5000], &builtin_corpus(5000, 1)[..]);
        assert!(a.iter().all(|&b| b == b'\n' || (32..127).contains(&b)));
        let s = String::from_utf8(a).unwrap();
        assert!(s.contains(". "), "{}", &s[..200]);
    }

    #[test]
    fn parse_rejects_text_the_grammar_cannot_emit() {
        assert!(Grammar::get().neg_log_prob(b"The cat the dog ").is_err());
        assert!(Grammar::get().neg_log_prob(b"The cat sleeps. ").is_ok());
    }
}
