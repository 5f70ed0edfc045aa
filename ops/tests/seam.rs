//! The device seam, checked two ways.
//!
//! 1. Only CPU kernel files touch host memory. Kernel files are the files under a folder named
//!    `cpu` (the shared helpers in `src/cpu/`, an op's `cpu/` folder) and files named `cpu.rs`;
//!    test code (`#[cfg(test)]` modules, `tests.rs`, `*_tests.rs`, `testing.rs`) may read
//!    results back. Anywhere else, a host-access call fails this test, which lists every
//!    offender as `path:line: call`.
//! 2. Every op with a kernel refuses a CUDA tensor with the error of its CUDA arm ("… has no
//!    CUDA kernel in this build"), naming the op, and never reads the tensor's memory as host
//!    memory.

use std::path::{Path, PathBuf};

use tandem_core::{CpuStorage, DType, Device, Generator, Layout, Storage, Tensor};
use tandem_ops as ops;

/// Calls that reach host memory (or copy a tensor's elements to the host to compute on them).
const HOST_ACCESS: [&str; 9] = [
    ".read_slice",
    ".write_slice",
    "read_host(",
    "write_host(",
    "::slice(",
    "::slice_mut(",
    ".to_vec::<",
    ".to_vec_f64(",
    ".item(",
];

/// Whether `path` (relative to the crate root) is a CPU kernel file.
fn is_kernel_file(path: &Path) -> bool {
    path.components()
        .any(|c| c.as_os_str() == "cpu" || c.as_os_str() == "cpu.rs")
}

/// Whether `path` holds only test code.
fn is_test_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "tests.rs" || name == "testing.rs" || name.ends_with("_tests.rs")
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `source` with comments, string and character literals blanked out (newlines kept, so line
/// numbers stay right), and every `#[cfg(test)]` item removed.
fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_before(&chars, i) {
            // raw string r"…" or r#"…"#
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= chars.len() {
                    break;
                }
                if chars[j] == '"' && (0..hashes).all(|k| chars.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &ch in &chars[i..j.min(chars.len())] {
                out.push(blank(ch));
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < chars.len() {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{..}') or a lifetime ('a).
            let literal_end = if next == Some('\\') {
                chars[i + 2..]
                    .iter()
                    .position(|&ch| ch == '\'')
                    .map(|p| i + 3 + p)
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 3)
            } else {
                None
            };
            match literal_end {
                Some(end) => {
                    for _ in i..end {
                        out.push(' ');
                    }
                    i = end;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    without_test_items(&out)
}

fn ident_before(chars: &[char], i: usize) -> bool {
    i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_')
}

/// Removes each `#[cfg(test)]` attribute and the item after it (up to its matching closing
/// brace, or its semicolon), keeping newlines.
fn without_test_items(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (k, ch) in item.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        out.extend(
            item[..end]
                .chars()
                .map(|c| if c == '\n' { '\n' } else { ' ' }),
        );
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

#[test]
fn only_cpu_kernel_files_touch_host_memory() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    files.sort();
    let mut offenders = Vec::new();
    let mut checked = 0;
    for path in &files {
        let relative = path.strip_prefix(&root).expect("under the crate root");
        if is_kernel_file(relative) || is_test_file(relative) {
            continue;
        }
        checked += 1;
        let source = std::fs::read_to_string(path).expect("readable source");
        for (n, line) in code_only(&source).lines().enumerate() {
            for call in HOST_ACCESS {
                if line.contains(call) {
                    offenders.push(format!("{}:{}: {call}", relative.display(), n + 1));
                }
            }
        }
    }
    assert!(checked > 20, "only {checked} non-kernel files found");
    assert!(
        offenders.is_empty(),
        "host memory is touched outside the CPU kernel files:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_scanner_sees_calls_in_code_but_not_in_comments_strings_or_tests() {
    let source = r##"
// x.read_slice::<f32>() in a comment
/* y.write_slice /* nested */ */
fn f(x: &Tensor) -> f64 {
    let s = "t.item()";
    let r = r#"x.to_vec::<f32>()"#;
    let c = '"';
    let _lifetime: &'static str = "";
    x.item().unwrap()
}
#[cfg(test)]
mod tests {
    fn g(x: &Tensor) { x.to_vec_f64().unwrap(); }
}
"##;
    let code = code_only(source);
    let hits: Vec<(usize, &str)> = code
        .lines()
        .enumerate()
        .flat_map(|(n, line)| {
            HOST_ACCESS
                .iter()
                .filter(move |call| line.contains(*call))
                .map(move |call| (n, *call))
        })
        .collect();
    assert_eq!(hits, vec![(8, ".item(")], "{code}");
    assert!(is_kernel_file(Path::new("src/conv2d/cpu/winograd.rs")));
    assert!(is_kernel_file(Path::new("src/loss/cpu.rs")));
    assert!(is_kernel_file(Path::new("src/cpu/memory.rs")));
    assert!(!is_kernel_file(Path::new("src/conv2d/mod.rs")));
    assert!(is_test_file(Path::new("src/batch_norm/relu_tests.rs")));
}

/// A tensor that claims to live on `cuda:0` and holds no memory there: any op that read it
/// as host memory would get an error from the storage, not the op's own.
fn on_cuda(shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let data = match dtype {
        DType::F32 => CpuStorage::F32(vec![0.5; n]),
        DType::I64 => CpuStorage::I64(vec![0; n]),
        other => panic!("unsupported test dtype {other}"),
    };
    Tensor::from_storage(
        Storage::host_memory_labelled(data, Device::Cuda(0)),
        Layout::contiguous(shape),
    )
    .expect("a placeholder tensor")
}

/// Every op now has a CUDA kernel; given a tensor that claims `cuda:0` but holds host memory,
/// each must fail with an error naming the device (no driver here, or on a GPU machine the
/// storage refusing to hand out a device pointer), never read the host memory as the
/// device's, never panic.
#[test]
fn every_op_on_a_cuda_labelled_host_tensor_fails_cleanly_naming_the_device() {
    let x = on_cuda(&[2, 3, 4, 4], DType::F32);
    let m = on_cuda(&[3, 3], DType::F32);
    let labels = on_cuda(&[3], DType::I64);
    let mut gen = Generator::new(1);
    let cases: Vec<(&str, tandem_core::Result<Tensor>)> = vec![
        ("add", ops::add(&x, &x)),
        ("mul_scalar", ops::mul_scalar(&x, 2.0)),
        ("add_relu", ops::add_relu(&x, &x)),
        ("relu", ops::relu(&x)),
        ("exp", ops::exp(&x)),
        ("sum", ops::sum(&x, &[1], false)),
        ("max", ops::max(&x, &[1], false)),
        ("argmax", ops::argmax(&x, 1, false)),
        ("softmax", ops::softmax(&m, 1)),
        ("cat", ops::cat(&[&m, &m], 0)),
        ("dropout", ops::dropout(&x, 0.5, true, &mut gen)),
        (
            "cross_entropy",
            ops::cross_entropy(&m, &labels, ops::Reduction::Mean),
        ),
        ("nll_loss", ops::nll_loss(&m, &labels, ops::Reduction::Sum)),
        ("mse_loss", ops::mse_loss(&m, &m, ops::Reduction::Mean)),
        // batch_norm has CUDA kernels (tests/cuda_batch_norm.rs).
    ];
    for (op, result) in cases {
        let err = match result {
            Ok(_) => panic!("{op} ran on a CUDA tensor"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("cuda:0"), "{op}: {err}");
    }
}
