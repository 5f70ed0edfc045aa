//! Finding, at run time, what tandem's programs read from the repository — the shipped data
//! sets (`data/`) and the benchmarks' PyTorch peer scripts (`benches/peers/`) — and where they
//! may write scratch files.
//!
//! Nothing here is fixed when the program is built: a test binary, example or benchmark copied
//! to another machine or another folder (the GPU bundle, say) finds the repository's files
//! relative to where it runs. The order, for each file or folder:
//!
//! 1. the command-line flag that names it (`--data-dir` for the MNIST folder), if given;
//! 2. the environment variable that names the folder holding it: [`DATA_DIR_VAR`]
//!    (`TANDEM_DATA_DIR`, the folder holding `mnist/`) and [`PEERS_DIR_VAR`]
//!    (`TANDEM_PEERS_DIR`, the folder holding the peer scripts);
//! 3. otherwise a search: in the current folder and every folder above it, then in the
//!    executable's folder and every folder above it, for the repository path (`data/mnist`,
//!    `benches/peers/train_step_torch.py`). So running from the repository root or any folder
//!    inside it works, and so does a binary kept anywhere under the repository.
//!
//! A flag or variable that names a missing path is an error, not a reason to search further:
//! what the user named explicitly is what runs. When nothing is found the error ([`NotFound`])
//! lists every place looked at and says which flag or variable would name it.
//!
//! Scratch space ([`scratch_dir`]) is a fresh folder under [`SCRATCH_DIR_VAR`]
//! (`TANDEM_SCRATCH_DIR`) if set, else under the system's temporary folder
//! ([`std::env::temp_dir`], which honours `TMPDIR`).

use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};

/// The environment variable naming the folder that holds the shipped data sets (the
/// repository's `data/`; MNIST is its `mnist/` folder).
pub const DATA_DIR_VAR: &str = "TANDEM_DATA_DIR";

/// The environment variable naming the folder that holds the benchmarks' PyTorch peer scripts
/// (the repository's `benches/peers/`).
pub const PEERS_DIR_VAR: &str = "TANDEM_PEERS_DIR";

/// The environment variable naming the folder under which [`scratch_dir`] creates its folders
/// (default: [`std::env::temp_dir`]).
pub const SCRATCH_DIR_VAR: &str = "TANDEM_SCRATCH_DIR";

/// A file or folder shipped in the repository, to be found at run time (see the module's
/// documentation for the order).
#[derive(Clone, Copy, Debug)]
pub struct Shipped<'a> {
    /// What it is, for messages ("the MNIST data").
    pub what: &'a str,
    /// The repository folder that holds it ("data", "benches/peers").
    pub folder: &'a str,
    /// Its path inside `folder` ("mnist", "train_step_torch.py").
    pub name: &'a str,
    /// The environment variable that names `folder` instead of the search.
    pub env_var: &'a str,
    /// The command-line flag that names the thing itself, if the program has one (for the
    /// error's advice).
    pub flag: Option<&'a str>,
}

impl Shipped<'_> {
    /// Finds it: `explicit` (the flag's value) if given, else under the environment variable's
    /// folder if set, else by searching from the current folder and from the executable's
    /// folder upwards.
    pub fn locate(&self, explicit: Option<&Path>) -> Result<PathBuf, NotFound> {
        let env_value = std::env::var_os(self.env_var);
        let mut starts = Vec::new();
        if let Ok(cwd) = std::env::current_dir() {
            starts.push(cwd);
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(Path::to_path_buf))
        {
            starts.push(dir);
        }
        self.locate_from(explicit, env_value.as_deref(), &starts)
    }

    /// [`Shipped::locate`] with the environment given: `env_value` is the variable's value (an
    /// empty value counts as unset), and the search starts in each of `starts` in turn and
    /// goes up from each.
    pub fn locate_from(
        &self,
        explicit: Option<&Path>,
        env_value: Option<&OsStr>,
        starts: &[PathBuf],
    ) -> Result<PathBuf, NotFound> {
        if let Some(path) = explicit {
            return existing(path).ok_or_else(|| self.not_found(Source::Flag, vec![path.into()]));
        }
        if let Some(folder) = env_value.filter(|v| !v.is_empty()) {
            let path = Path::new(folder).join(self.name);
            return existing(&path).ok_or_else(|| self.not_found(Source::EnvVar, vec![path]));
        }
        let relative = Path::new(self.folder).join(self.name);
        let mut looked: Vec<PathBuf> = Vec::new();
        for start in starts {
            for dir in start.ancestors() {
                let candidate = dir.join(&relative);
                if looked.contains(&candidate) {
                    continue;
                }
                if let Some(found) = existing(&candidate) {
                    return Ok(found);
                }
                looked.push(candidate);
            }
        }
        Err(self.not_found(Source::Search, looked))
    }

    fn not_found(&self, source: Source, looked: Vec<PathBuf>) -> NotFound {
        NotFound(Box::new(Missing {
            what: self.what.to_string(),
            relative: Path::new(self.folder).join(self.name),
            name: self.name.to_string(),
            env_var: self.env_var.to_string(),
            flag: self.flag.map(str::to_string),
            source,
            looked,
        }))
    }
}

fn existing(path: &Path) -> Option<PathBuf> {
    path.exists().then(|| path.to_path_buf())
}

/// Which way of naming the thing came up empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Flag,
    EnvVar,
    Search,
}

/// A shipped file or folder that is not where it was looked for; the message lists every
/// place looked at and how to name it. Its `Debug` is its message.
#[derive(Clone)]
pub struct NotFound(Box<Missing>);

/// What [`NotFound`] says (boxed: errors stay small).
#[derive(Clone, Debug)]
struct Missing {
    what: String,
    relative: PathBuf,
    name: String,
    env_var: String,
    flag: Option<String>,
    source: Source,
    looked: Vec<PathBuf>,
}

impl NotFound {
    /// Every path looked at, in order.
    pub fn looked(&self) -> &[PathBuf] {
        &self.0.looked
    }
}

impl fmt::Display for NotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.0;
        let list = m
            .looked
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        match m.source {
            Source::Flag => write!(
                f,
                "cannot find {}: {list} (given with {}) does not exist",
                m.what,
                m.flag.as_deref().unwrap_or("a flag")
            ),
            Source::EnvVar => write!(
                f,
                "cannot find {}: {list} does not exist ({} names its folder)",
                m.what, m.env_var
            ),
            Source::Search => {
                write!(
                    f,
                    "cannot find {} ({}) in the current folder, the executable's folder or any \
                     folder above them; looked at {list}; ",
                    m.what,
                    m.relative.display()
                )?;
                if let Some(flag) = &m.flag {
                    write!(f, "pass {flag}, or ")?;
                }
                write!(f, "set {} to the folder holding {}", m.env_var, m.name)
            }
        }
    }
}

impl std::error::Error for NotFound {}

tandem_core::debug_as_display!(NotFound);

/// The folder of the shipped MNIST files: `explicit` (`--data-dir`) if given, else
/// `$TANDEM_DATA_DIR/mnist`, else `data/mnist` found from the current folder or the
/// executable's (see the module's documentation).
pub fn mnist_dir(explicit: Option<&Path>) -> Result<PathBuf, NotFound> {
    MNIST.locate(explicit)
}

/// How the MNIST folder is found ([`mnist_dir`]).
pub const MNIST: Shipped<'static> = Shipped {
    what: "the MNIST data",
    folder: "data",
    name: "mnist",
    env_var: DATA_DIR_VAR,
    flag: Some("--data-dir"),
};

/// The benchmarks' PyTorch peer script `name` (`train_step_torch.py`, …):
/// `$TANDEM_PEERS_DIR/name`, else `benches/peers/name` found from the current folder or the
/// executable's (see the module's documentation).
pub fn peer_script(name: &str) -> Result<PathBuf, NotFound> {
    peer(name).locate(None)
}

/// Where the peer script `name` ships (see [`peer_script`]).
fn peer(name: &str) -> Shipped<'_> {
    Shipped {
        what: "the PyTorch peer script",
        folder: "benches/peers",
        name,
        env_var: PEERS_DIR_VAR,
        flag: None,
    }
}

/// A fresh, empty folder for scratch files, `tandem-{name}-{process id}` under
/// `$TANDEM_SCRATCH_DIR` (created if missing) or else under [`std::env::temp_dir`]. The
/// caller removes it when done.
pub fn scratch_dir(name: &str) -> std::io::Result<PathBuf> {
    let base = std::env::var_os(SCRATCH_DIR_VAR)
        .filter(|v| !v.is_empty())
        .map_or_else(std::env::temp_dir, PathBuf::from);
    scratch_dir_in(&base, name)
}

fn scratch_dir_in(base: &Path, name: &str) -> std::io::Result<PathBuf> {
    let dir = base.join(format!("tandem-{name}-{}", std::process::id()));
    let context = |e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("scratch folder {}: {e}", dir.display()))
    };
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(context)?;
    }
    std::fs::create_dir_all(&dir).map_err(context)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder tree for one test, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new(test: &str) -> Tree {
            let root =
                std::env::temp_dir().join(format!("tandem-locate-{test}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            Tree(root)
        }

        fn dir(&self, relative: &str) -> PathBuf {
            let path = self.0.join(relative);
            std::fs::create_dir_all(&path).unwrap();
            path
        }

        fn file(&self, relative: &str) -> PathBuf {
            let path = self.0.join(relative);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, "print('peer')\n").unwrap();
            path
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn found_from_a_folder_nested_below_the_repository() {
        let tree = Tree::new("nested");
        let mnist = tree.dir("repo/data/mnist");
        let cwd = tree.dir("repo/a/b/c");
        assert_eq!(MNIST.locate_from(None, None, &[cwd]).unwrap(), mnist);
    }

    #[test]
    fn found_from_the_executables_folder_when_the_current_folder_has_nothing() {
        let tree = Tree::new("exe");
        let script = tree.file("repo/benches/peers/train_step_torch.py");
        let cwd = tree.dir("elsewhere/work");
        let exe_dir = tree.dir("repo/gpu-bundle/bin");
        let found = peer("train_step_torch.py")
            .locate_from(None, None, &[cwd, exe_dir])
            .unwrap();
        assert_eq!(found, script);
    }

    #[test]
    fn the_current_folder_is_searched_before_the_executables() {
        let tree = Tree::new("order");
        let near = tree.dir("work/data/mnist");
        tree.dir("repo/data/mnist");
        let starts = [tree.dir("work"), tree.dir("repo/bin")];
        assert_eq!(MNIST.locate_from(None, None, &starts).unwrap(), near);
    }

    #[test]
    fn a_flag_wins_over_the_variable_and_the_variable_over_the_search() {
        let tree = Tree::new("override");
        tree.dir("repo/data/mnist");
        let from_var = tree.dir("shared/mnist");
        let from_flag = tree.dir("mine");
        let starts = [tree.dir("repo")];
        let var = tree.0.join("shared");
        let found = MNIST
            .locate_from(Some(&from_flag), Some(var.as_os_str()), &starts)
            .unwrap();
        assert_eq!(found, from_flag);
        let found = MNIST
            .locate_from(None, Some(var.as_os_str()), &starts)
            .unwrap();
        assert_eq!(found, from_var);
        // An empty variable counts as unset.
        let found = MNIST
            .locate_from(None, Some(OsStr::new("")), &starts)
            .unwrap();
        assert_eq!(found, tree.0.join("repo/data/mnist"));
    }

    #[test]
    fn a_missing_named_path_is_an_error_even_when_the_search_would_find_one() {
        let tree = Tree::new("named-missing");
        tree.dir("repo/data/mnist");
        let starts = [tree.dir("repo")];
        let missing = tree.0.join("nowhere");
        let e = MNIST
            .locate_from(Some(&missing), None, &starts)
            .unwrap_err();
        let text = e.to_string();
        assert!(text.contains(&missing.display().to_string()), "{text}");
        assert!(text.contains("--data-dir"), "{text}");
        let e = MNIST
            .locate_from(None, Some(missing.as_os_str()), &starts)
            .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&missing.join("mnist").display().to_string()),
            "{text}"
        );
        assert!(text.contains(DATA_DIR_VAR), "{text}");
    }

    #[test]
    fn not_found_names_every_place_searched_and_how_to_name_it() {
        let tree = Tree::new("not-found");
        let cwd = tree.dir("work/deep");
        let exe_dir = tree.dir("bundle/bin");
        let e = peer("ddp_step_torch.py")
            .locate_from(None, None, &[cwd.clone(), exe_dir.clone()])
            .unwrap_err();
        let text = e.to_string();
        for place in [
            cwd.join("benches/peers/ddp_step_torch.py"),
            tree.0.join("work/benches/peers/ddp_step_torch.py"),
            exe_dir.join("benches/peers/ddp_step_torch.py"),
            tree.0.join("bundle/benches/peers/ddp_step_torch.py"),
            tree.0.join("benches/peers/ddp_step_torch.py"),
        ] {
            assert!(e.looked().contains(&place), "{place:?} not in {text}");
            assert!(text.contains(&place.display().to_string()), "{text}");
        }
        // The common ancestors are looked at once.
        let root_candidate = PathBuf::from("/benches/peers/ddp_step_torch.py");
        assert_eq!(
            e.looked().iter().filter(|p| **p == root_candidate).count(),
            1
        );
        assert!(text.contains(PEERS_DIR_VAR), "{text}");
        let e = MNIST.locate_from(None, None, &[cwd]).unwrap_err();
        assert!(e.to_string().contains("pass --data-dir"), "{e}");
        // What `unwrap()` and `main`'s error print: the message, not the fields.
        assert_eq!(format!("{e:?}"), e.to_string());
    }

    #[test]
    fn the_repositorys_mnist_is_found_from_where_cargo_runs_the_tests() {
        // Cargo runs unit tests in the package's folder, the repository root.
        if std::env::var_os(DATA_DIR_VAR).is_some() {
            return;
        }
        let dir = mnist_dir(None).unwrap();
        assert!(dir.join("SHA256SUMS").is_file(), "{}", dir.display());
        assert!(peer_script("train_step_torch.py").unwrap().is_file());
    }

    #[test]
    fn scratch_folders_are_fresh_and_under_the_base() {
        let tree = Tree::new("scratch");
        let dir = scratch_dir_in(&tree.0.join("base"), "check").unwrap();
        assert!(dir.starts_with(tree.0.join("base")));
        std::fs::write(dir.join("old"), "x").unwrap();
        let again = scratch_dir_in(&tree.0.join("base"), "check").unwrap();
        assert_eq!(again, dir);
        assert!(!again.join("old").exists());
    }
}
