//! The one table writer of every kv-bench report: aligned plain text for terminals, padded
//! GitHub markdown for documents.

/// Output style of a [`Table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Aligned plain text.
    Plain,
    /// GitHub-flavoured markdown.
    Markdown,
}

/// Rows of cells under a header; the first column is left-aligned, the others right-aligned
/// unless marked with [`Table::left`].
#[derive(Debug, Clone, Default)]
pub struct Table {
    header: Vec<String>,
    left: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with these column names.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        let header: Vec<String> = header.into_iter().map(Into::into).collect();
        let left = (0..header.len()).map(|i| i == 0).collect();
        Self {
            header,
            left,
            rows: Vec::new(),
        }
    }

    /// Left-aligns column `col` too (text columns).
    pub fn left(mut self, col: usize) -> Self {
        if let Some(l) = self.left.get_mut(col) {
            *l = true;
        }
        self
    }

    /// Whether it has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Appends a row (missing cells are empty, extra ones dropped).
    pub fn row(&mut self, mut cells: Vec<String>) {
        cells.resize(self.header.len(), String::new());
        self.rows.push(cells);
    }

    /// The table as text, ending with a newline.
    pub fn render(&self, style: Style) -> String {
        let width: Vec<usize> = (0..self.header.len())
            .map(|c| {
                std::iter::once(&self.header)
                    .chain(&self.rows)
                    .map(|r| r[c].chars().count())
                    .max()
                    .unwrap_or(0)
                    // Room for a markdown alignment rule (`--:`).
                    .max(3)
            })
            .collect();
        let cells = |r: &[String]| -> Vec<String> {
            r.iter()
                .zip(&width)
                .zip(&self.left)
                .map(|((v, &w), &left)| {
                    if left {
                        format!("{v:<w$}")
                    } else {
                        format!("{v:>w$}")
                    }
                })
                .collect()
        };
        let mut out = String::new();
        match style {
            Style::Markdown => {
                let rule: Vec<String> = width
                    .iter()
                    .zip(&self.left)
                    .map(|(&w, &left)| {
                        if left {
                            "-".repeat(w)
                        } else {
                            format!("{}:", "-".repeat(w - 1))
                        }
                    })
                    .collect();
                out.push_str(&format!("| {} |\n", cells(&self.header).join(" | ")));
                out.push_str(&format!("| {} |\n", rule.join(" | ")));
                for r in &self.rows {
                    out.push_str(&format!("| {} |\n", cells(r).join(" | ")));
                }
            }
            Style::Plain => {
                let line = |r: &[String]| format!("{}\n", cells(r).join("  ").trim_end());
                out.push_str(&line(&self.header));
                let total = width.iter().sum::<usize>() + 2 * width.len().saturating_sub(1);
                out.push_str(&"-".repeat(total));
                out.push('\n');
                for r in &self.rows {
                    out.push_str(&line(r));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table {
        let mut t = Table::new(["name", "path", "n"]).left(1);
        t.row(vec!["a".into(), "x".into(), "1".into()]);
        t.row(vec!["bbb".into(), "yyyy".into(), "22".into()]);
        t
    }

    #[test]
    fn markdown_is_padded_with_alignment_rules() {
        assert_eq!(
            table().render(Style::Markdown),
            "| name | path |   n |\n\
             | ---- | ---- | --: |\n\
             | a    | x    |   1 |\n\
             | bbb  | yyyy |  22 |\n"
        );
    }

    #[test]
    fn plain_text_aligns_columns_under_a_rule() {
        assert_eq!(
            table().render(Style::Plain),
            "name  path    n\n---------------\na     x       1\nbbb   yyyy   22\n"
        );
    }
}
