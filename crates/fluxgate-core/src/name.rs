//! [`Name`]: the name of a rule set, rule or band, copied into every decision without a
//! reference count.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};

/// The most names interned per process, and the most bytes of them: names beyond are
/// reference-counted instead, so that loading ever new names cannot grow the process
/// without bound.
const MAX_INTERNED: usize = 1 << 16;
const MAX_INTERNED_BYTES: usize = 4 << 20;

struct Interned {
    names: HashSet<Kept>,
    bytes: usize,
}

/// An interned text, behind a thin pointer so that a [`Name`] is two words.
#[derive(Clone, Copy)]
struct Kept(&'static &'static str);

impl Kept {
    fn text(self) -> &'static str {
        self.0
    }
}

impl PartialEq for Kept {
    fn eq(&self, other: &Self) -> bool {
        self.text() == other.text()
    }
}

impl Eq for Kept {}

impl Hash for Kept {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.text().hash(state);
    }
}

impl Borrow<str> for Kept {
    fn borrow(&self) -> &str {
        self.text()
    }
}

static INTERNED: Mutex<Option<Interned>> = Mutex::new(None);

/// The name of a rule set, rule or band, as decisions report it.
///
/// Names given by rules ([`Name::new`], and `From<&str>` / `From<String>`) are interned
/// once per process: each distinct name is kept for the life of the process, and a clone
/// is a copy of a pointer. A decision names its rule set, rules and bands with such clones,
/// so that threads deciding at the same time never write to a shared reference count. At
/// most 65,536 names (4 MiB) are interned; further ones, and names made
/// [`From<Arc<str>>`](#impl-From<Arc<str>>-for-Name) (such as a rule set id taken from a
/// request), are reference-counted.
///
/// A name compares, hashes, displays and dereferences as the text it holds.
///
/// ```
/// use fluxgate_core::Name;
/// let a = Name::new("per-ip");
/// let b = Name::from(String::from("per-ip"));
/// assert_eq!(a, b);
/// assert_eq!(&*a, "per-ip");
/// assert_eq!(a, "per-ip");
/// assert_eq!(a.to_string(), "per-ip");
/// ```
#[derive(Clone)]
pub struct Name(Repr);

#[derive(Clone)]
enum Repr {
    Interned(Kept),
    Shared(Arc<str>),
}

impl Name {
    /// The interned name `text` (see the type's documentation).
    pub fn new(text: &str) -> Self {
        let mut guard = INTERNED.lock().unwrap_or_else(PoisonError::into_inner);
        let interned = guard.get_or_insert_with(|| Interned {
            names: HashSet::new(),
            bytes: 0,
        });
        if let Some(found) = interned.names.get(text) {
            return Self(Repr::Interned(*found));
        }
        if interned.names.len() >= MAX_INTERNED || interned.bytes + text.len() > MAX_INTERNED_BYTES {
            return Self(Repr::Shared(Arc::from(text)));
        }
        let kept = Kept(Box::leak(Box::new(&*Box::leak(Box::<str>::from(text)))));
        interned.names.insert(kept);
        interned.bytes += text.len();
        Self(Repr::Interned(kept))
    }

    /// The interned text, or the reference-counted one.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn parts(&self) -> Result<&'static str, &Arc<str>> {
        match &self.0 {
            Repr::Interned(s) => Ok(s.text()),
            Repr::Shared(s) => Err(s),
        }
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            Repr::Interned(s) => s.text(),
            Repr::Shared(s) => s,
        }
    }
}

impl Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Repr::Interned(a), Repr::Interned(b)) if std::ptr::eq(a.0, b.0) => true,
            _ => self.as_str() == other.as_str(),
        }
    }
}

impl Eq for Name {}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<Name> for str {
    fn eq(&self, other: &Name) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Name> for &str {
    fn eq(&self, other: &Name) -> bool {
        *self == other.as_str()
    }
}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for Name {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl From<String> for Name {
    fn from(text: String) -> Self {
        Self::new(&text)
    }
}

impl From<&String> for Name {
    fn from(text: &String) -> Self {
        Self::new(text)
    }
}

/// Reference-counted, not interned: for names that do not come from rules.
impl From<Arc<str>> for Name {
    fn from(text: Arc<str>) -> Self {
        Self(Repr::Shared(text))
    }
}

impl From<&Name> for Name {
    fn from(name: &Name) -> Self {
        name.clone()
    }
}

impl From<Name> for Arc<str> {
    fn from(name: Name) -> Self {
        match name.0 {
            Repr::Interned(s) => Arc::from(s.text()),
            Repr::Shared(s) => s,
        }
    }
}

impl From<Name> for String {
    fn from(name: Name) -> Self {
        name.as_str().to_owned()
    }
}

impl serde::Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_names_are_interned_once_and_clones_share_the_text() {
        let a = Name::new("name-test-a");
        let b = Name::from(String::from("name-test-a"));
        match (&a.0, &b.0) {
            (Repr::Interned(x), Repr::Interned(y)) => assert!(std::ptr::eq(x.0, y.0)),
            _ => panic!("not interned"),
        }
        let shared = Name::from(Arc::<str>::from("name-test-a"));
        assert!(matches!(shared.0, Repr::Shared(_)));
        assert_eq!(a, shared);
        assert_eq!(std::mem::size_of::<Name>(), 16);
        let mut set = HashSet::new();
        set.insert(a);
        assert!(set.contains("name-test-a"));
        assert!(set.contains(&shared));
    }
}
