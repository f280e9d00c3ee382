//! How far the prompt estimate is from real tokenizers' counts: each sample request of the
//! corpus in `tests/data/prompts/` (a folder a category) estimated by [`super::estimate`], as
//! admission estimates it, and counted with o200k_base (GPT-4o family) and cl100k_base (GPT-4
//! family); the ratios per category, the bounds they are held to, and the README's table of them.
//!
//! The real count is what a backend bills as the prompt (`usage.prompt_tokens`): the messages'
//! contents and roles and each message's framing, as OpenAI's cookbook counts them for these
//! families (checked against `tiktoken_rs::num_tokens_from_messages`). The tokenizers' ranks
//! are compiled into tiktoken-rs: nothing is downloaded.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::Value;
use tiktoken_rs::CoreBPE;

use super::estimate;

/// The corpus's categories: folder, and the row's label in the README's table.
const CATEGORIES: [(&str, &str); 6] = [
    ("prose", "English prose"),
    ("chat", "chat, many short messages"),
    ("code", "source code (Rust, Python)"),
    ("json", "JSON"),
    ("logs", "logs and tables (English, numbers)"),
    ("chinese", "Chinese"),
];

/// Tokens a chat message costs besides its role's and its content's (the framing around it),
/// and tokens priming the reply, once a request: OpenAI's cookbook's count for the GPT-4 and
/// GPT-4o families.
const TOKENS_PER_MESSAGE: usize = 3;
const REPLY_PRIMING: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tokenizer {
    O200k,
    Cl100k,
}

use Tokenizer::{Cl100k, O200k};

impl Tokenizer {
    const ALL: [Tokenizer; 2] = [O200k, Cl100k];

    fn bpe(self) -> &'static CoreBPE {
        match self {
            O200k => tiktoken_rs::o200k_base_singleton(),
            Cl100k => tiktoken_rs::cl100k_base_singleton(),
        }
    }

    /// A model of the family, for tiktoken-rs's own count of a chat.
    fn model(self) -> &'static str {
        match self {
            O200k => "gpt-4o",
            Cl100k => "gpt-4",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One sample's counts.
#[derive(Debug)]
struct Sample {
    category: &'static str,
    name: String,
    /// The gateway's prompt estimate of the request body.
    estimate: u64,
    /// Per tokenizer (by [`Tokenizer::index`]): the tokens of the messages' contents alone.
    text: [usize; 2],
    /// Per tokenizer: the prompt tokens billed (contents, roles, framing, priming).
    billed: [usize; 2],
}

fn measure(category: &'static str, name: String, body: &[u8]) -> Sample {
    let estimate = estimate(Some(body), body.len() as u64, 0).prompt;
    let req: Value = serde_json::from_slice(body).expect("a sample is JSON");
    let messages: Vec<(&str, &str)> = req["messages"]
        .as_array()
        .expect("a sample is a chat request")
        .iter()
        .map(|m| {
            let role = m["role"].as_str().expect("a role");
            let content = m["content"].as_str().expect("a text content");
            (role, content)
        })
        .collect();
    let (mut text, mut billed) = ([0; 2], [0; 2]);
    for t in Tokenizer::ALL {
        let count = |s: &str| t.bpe().encode_ordinary(s).len();
        text[t.index()] = messages.iter().map(|(_, c)| count(c)).sum();
        billed[t.index()] = messages
            .iter()
            .map(|(r, c)| TOKENS_PER_MESSAGE + count(r) + count(c))
            .sum::<usize>()
            + REPLY_PRIMING;
        let wire: Vec<_> = messages
            .iter()
            .map(|(r, c)| tiktoken_rs::ChatCompletionRequestMessage {
                role: (*r).to_owned(),
                content: Some((*c).to_owned()),
                ..Default::default()
            })
            .collect();
        let theirs = tiktoken_rs::num_tokens_from_messages(t.model(), &wire).expect("a chat model");
        assert_eq!(billed[t.index()], theirs, "{category}/{name} with {t:?}");
    }
    Sample {
        category,
        name,
        estimate,
        text,
        billed,
    }
}

/// Every sample, measured once for all the tests.
fn samples() -> &'static [Sample] {
    static SAMPLES: OnceLock<Vec<Sample>> = OnceLock::new();
    SAMPLES.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/prompts");
        let mut out = Vec::new();
        for (category, _) in CATEGORIES {
            let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(category))
                .expect("the category's folder")
                .map(|e| e.expect("an entry").path())
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .collect();
            files.sort();
            for f in files {
                let body = std::fs::read(&f).expect("a sample");
                let name = f.file_stem().expect("a name").to_string_lossy();
                out.push(measure(category, name.into_owned(), &body));
            }
        }
        out
    })
}

/// The smallest, the median and the largest of a category's ratios.
#[derive(Clone, Copy, Debug)]
struct Spread {
    min: f64,
    median: f64,
    max: f64,
}

impl Spread {
    fn of(mut ratios: Vec<f64>) -> Spread {
        assert!(!ratios.is_empty(), "no ratios");
        ratios.sort_by(f64::total_cmp);
        let n = ratios.len();
        let median = if n % 2 == 1 {
            ratios[n / 2]
        } else {
            (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0
        };
        Spread {
            min: ratios[0],
            median,
            max: ratios[n - 1],
        }
    }
}

/// Estimate ÷ billed prompt tokens of a category's samples, with a tokenizer.
fn billed_ratios(category: &str, t: Tokenizer) -> Spread {
    Spread::of(
        samples()
            .iter()
            .filter(|s| s.category == category)
            .map(|s| s.estimate as f64 / s.billed[t.index()] as f64)
            .collect(),
    )
}

/// Estimate ÷ the tokens of the messages' contents alone (no framing).
fn text_ratios(category: &str, t: Tokenizer) -> Spread {
    Spread::of(
        samples()
            .iter()
            .filter(|s| s.category == category)
            .map(|s| s.estimate as f64 / s.text[t.index()] as f64)
            .collect(),
    )
}

/// Every ratio of `category` with each tokenizer within `all`, and their median within
/// `median`.
fn assert_ratios(category: &str, t: Tokenizer, all: (f64, f64), median: (f64, f64)) {
    let s = billed_ratios(category, t);
    assert!(
        all.0 <= s.min && s.max <= all.1,
        "{category} with {t:?}: {s:?} outside {all:?}\n{}",
        table()
    );
    assert!(
        median.0 <= s.median && s.median <= median.1,
        "{category} with {t:?}: median {s:?} outside {median:?}\n{}",
        table()
    );
}

/// The README's table of the measured ratios, as it should read.
fn table() -> String {
    let mut out = String::from(
        "| prompt (samples) | o200k_base (GPT-4o family) | cl100k_base (GPT-4 family) |\n|---|---|---|\n",
    );
    for (category, label) in CATEGORIES {
        let n = samples().iter().filter(|s| s.category == category).count();
        let _ = write!(out, "| {label} ({n}) |");
        for t in Tokenizer::ALL {
            let s = billed_ratios(category, t);
            let _ = write!(out, " {:.2} ({:.2}–{:.2}) |", s.median, s.min, s.max);
        }
        out.push('\n');
    }
    out
}

#[test]
fn every_category_has_five_samples_of_fifty_to_three_thousand_tokens() {
    for (category, _) in CATEGORIES {
        let of: Vec<&Sample> = samples()
            .iter()
            .filter(|s| s.category == category)
            .collect();
        assert!(of.len() >= 5, "{category}: {} samples", of.len());
        for s in of {
            for n in s.billed {
                assert!((50..=3000).contains(&n), "{category}/{}: {n}", s.name);
            }
        }
    }
}

#[test]
fn the_estimate_of_english_prose_is_high_by_a_tenth_to_a_third() {
    for t in Tokenizer::ALL {
        assert_ratios("prose", t, (1.05, 1.35), (1.15, 1.25));
    }
}

/// Its contents alone are estimated about right; what it is billed besides, the framing of
/// each message (3 tokens and its role), the estimate does not count.
#[test]
fn the_estimate_of_a_chat_of_short_messages_is_low_by_its_framing() {
    for t in Tokenizer::ALL {
        assert_ratios("chat", t, (0.5, 0.9), (0.72, 0.85));
        let contents = text_ratios("chat", t);
        assert!(
            (0.95..=1.15).contains(&contents.median),
            "{t:?}: contents alone {contents:?}"
        );
    }
}

#[test]
fn the_estimate_of_source_code_is_a_tenth_low_at_the_median() {
    for t in Tokenizer::ALL {
        assert_ratios("code", t, (0.6, 1.15), (0.85, 1.0));
    }
}

/// JSON of words (a manifest, a schema) is estimated high, JSON of numbers half of it.
#[test]
fn the_estimate_of_json_is_a_quarter_low_at_the_median_and_half_with_numbers() {
    for t in Tokenizer::ALL {
        assert_ratios("json", t, (0.45, 1.2), (0.7, 0.82));
    }
}

#[test]
fn the_estimate_of_logs_and_tables_is_low_by_about_half() {
    for t in Tokenizer::ALL {
        assert_ratios("logs", t, (0.45, 0.72), (0.48, 0.58));
    }
}

/// A CJK character is 3 bytes of UTF-8, so ¾ of a token by the estimate: about what o200k_base
/// spends on one, and less than cl100k_base's 1 to 1.5.
#[test]
fn the_estimate_of_chinese_is_right_for_o200k_and_a_third_low_for_cl100k() {
    assert_ratios("chinese", O200k, (0.95, 1.08), (0.98, 1.06));
    assert_ratios("chinese", Cl100k, (0.64, 0.75), (0.65, 0.72));
}

/// The table in the README's "Admission before the call", read back: each cell's median, min
/// and max equal to the measured ones at two decimals.
#[test]
fn the_readme_table_agrees_with_the_measured_ratios() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("the README");
    let expected = table();
    let mut lines = readme
        .lines()
        .skip_while(|l| !(l.starts_with("| prompt (samples)") && l.contains("o200k_base")));
    assert!(
        lines.next().is_some(),
        "no table in the README:\n{expected}"
    );
    let rows: Vec<&str> = lines.skip(1).take_while(|l| l.starts_with('|')).collect();
    assert_eq!(
        rows.len(),
        CATEGORIES.len(),
        "the README's rows:\n{expected}"
    );
    let number = |s: &str| -> f64 {
        s.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{s:?} is not a number:\n{expected}"))
    };
    for (row, (category, label)) in rows.iter().zip(CATEGORIES) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').collect();
        assert_eq!(cells.len(), 3, "{row}");
        assert!(
            cells[0].trim().starts_with(label),
            "{row}: not {label}:\n{expected}"
        );
        for (t, cell) in Tokenizer::ALL.into_iter().zip(&cells[1..]) {
            // "median (min–max)"
            let (median, range) = cell.trim().split_once(" (").expect("median (min–max)");
            let (min, max) = range
                .trim_end_matches(')')
                .split_once('–')
                .expect("min–max");
            let s = billed_ratios(category, t);
            for (written, measured) in [(median, s.median), (min, s.min), (max, s.max)] {
                assert!(
                    (number(written) - measured).abs() <= 0.005 + 1e-9,
                    "{label} with {t:?}: the README says {written}, measured {measured:.3}:\n{expected}"
                );
            }
        }
    }
}
