//! Cursor paging of the operator API's lists that grow with the rules (`/v1/targets`, an
//! event's targets in its fate, `/v1/rules`): a page of at most `limit` items after the cursor
//! `after`, and the cursor of the next page (null on the last), as the DLQ list pages.

use crate::event::FieldError;

/// The largest page, and the page when `limit` is not given: at a few thousand targets one
/// answer of everything ran to megabytes, built in one go.
pub const MAX_PAGE: usize = 1000;

/// The page size a `limit` parameter asks for (default and maximum [`MAX_PAGE`]), or the error
/// pointing at it. (A non-numeric or negative one is refused by the query's parse, with the
/// same pointer.)
pub fn page_limit(limit: Option<usize>) -> Result<usize, FieldError> {
    match limit {
        None => Ok(MAX_PAGE),
        Some(n) if (1..=MAX_PAGE).contains(&n) => Ok(n),
        Some(_) => Err(FieldError::new(
            "/limit",
            format!("limit must be in 1..={MAX_PAGE}"),
        )),
    }
}

/// One page of a list.
#[derive(Debug, PartialEq)]
pub struct Page<T> {
    /// At most the page's limit of items, in the list's order.
    pub items: Vec<T>,
    /// The cursor of the next page (pass as `after`): the last item's; `None` on the last page.
    pub next: Option<String>,
}

/// The first `limit` items of `rest` (the list from just after the cursor on) and, when more
/// follow, the cursor of the next page (`cursor` of the page's last item). One item past the
/// page is read to tell whether more follow, so a page that ends the list exactly has no next
/// page to come back for.
pub fn take_page<T>(
    rest: impl IntoIterator<Item = T>,
    limit: usize,
    cursor: impl Fn(&T) -> String,
) -> Page<T> {
    let mut items: Vec<T> = rest.into_iter().take(limit.saturating_add(1)).collect();
    let more = items.len() > limit;
    items.truncate(limit);
    let next = more.then(|| items.last().map(&cursor)).flatten();
    Page { items, next }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_one_to_the_maximum_and_defaults_to_it() {
        assert_eq!(page_limit(None), Ok(MAX_PAGE));
        assert_eq!(page_limit(Some(1)), Ok(1));
        assert_eq!(page_limit(Some(MAX_PAGE)), Ok(MAX_PAGE));
        for bad in [0, MAX_PAGE + 1, usize::MAX] {
            let e = page_limit(Some(bad)).expect_err("out of range");
            assert_eq!(e.pointer, "/limit");
        }
    }

    #[test]
    fn pages_join_to_the_whole_list_once_and_the_last_has_no_next() {
        let list: Vec<u32> = (1..=25).collect();
        for limit in [1, 4, 5, 24, 25, 26, 1000] {
            let mut seen: Vec<u32> = Vec::new();
            let mut after: Option<u32> = None;
            let mut pages = 0;
            loop {
                let rest = list
                    .iter()
                    .copied()
                    .filter(|n| after.is_none_or(|a| *n > a));
                let page = take_page(rest, limit, u32::to_string);
                pages += 1;
                assert!(page.items.len() <= limit);
                seen.extend(&page.items);
                match page.next {
                    Some(c) => {
                        assert_eq!(
                            Some(c.as_str()),
                            page.items.last().map(|n| n.to_string()).as_deref()
                        );
                        after = Some(c.parse().expect("a cursor"));
                    }
                    None => break,
                }
            }
            assert_eq!(seen, list, "limit {limit}");
            // No empty page at the end when the list ends with a full page.
            assert_eq!(pages, list.len().div_ceil(limit), "limit {limit}");
        }
    }

    #[test]
    fn an_empty_rest_is_an_empty_last_page() {
        let page = take_page(Vec::<u32>::new(), 10, u32::to_string);
        assert_eq!(
            page,
            Page {
                items: vec![],
                next: None
            }
        );
    }
}
