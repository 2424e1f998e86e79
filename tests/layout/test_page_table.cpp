#include <gtest/gtest.h>

#include <vector>

#include "kvq/layout/page_table.hpp"

namespace {

using kvq::StatusCode;

struct Table {
  std::vector<std::int32_t> indptr, indices, last;
  int page_size = 16;
  kvq::PageTableView view() const {
    return {indptr.data(), indices.data(), last.data(), int(last.size()), page_size};
  }
};

TEST(PageTable, LengthsAndAddressing) {
  const Table t{{0, 2, 2, 5}, {7, 3, 0, 1, 2}, {5, 0, 16}};
  const auto v = t.view();
  EXPECT_EQ(v.seq_len(0), 21);
  EXPECT_EQ(v.seq_len(1), 0);
  EXPECT_EQ(v.seq_len(2), 48);
  EXPECT_EQ(v.page_of(0, 15), 7);
  EXPECT_EQ(v.page_of(0, 16), 3);
  EXPECT_EQ(v.page_of(2, 47), 2);
  EXPECT_TRUE(kvq::validate_page_table(v, 8).ok());
}

TEST(PageTable, RejectsInconsistentTables) {
  EXPECT_EQ(kvq::validate_page_table(Table{{0, 2}, {7, 3}, {5}}.view(), 7).code(), StatusCode::out_of_range);
  EXPECT_EQ(kvq::validate_page_table(Table{{0, 2}, {-1, 3}, {5}}.view(), 8).code(), StatusCode::out_of_range);
  EXPECT_EQ(kvq::validate_page_table(Table{{0, 2}, {1, 3}, {17}}.view(), 8).code(), StatusCode::out_of_range);
  EXPECT_EQ(kvq::validate_page_table(Table{{0, 2}, {1, 3}, {0}}.view(), 8).code(), StatusCode::out_of_range);
  EXPECT_EQ(kvq::validate_page_table(Table{{0, 0}, {}, {3}}.view(), 8).code(), StatusCode::out_of_range);
  EXPECT_EQ(kvq::validate_page_table(Table{{0, 2, 1}, {1, 3}, {1, 1}}.view(), 8).code(), StatusCode::invalid_argument);
  EXPECT_EQ(kvq::validate_page_table(Table{{1, 2}, {1, 3}, {1}}.view(), 8).code(), StatusCode::invalid_argument);
  kvq::PageTableView null_view{};
  null_view.batch_size = 1;
  EXPECT_EQ(kvq::validate_page_table(null_view, 8).code(), StatusCode::invalid_argument);
  const auto s = kvq::validate_page_table(Table{{0, 2}, {1, 9}, {1}}.view(), 8);
  EXPECT_NE(s.message().find("indices[1] = 9"), std::string::npos) << s.message();
}

// num_indices, when given, bounds indptr: a table whose indptr runs past the engine's
// indices array is rejected before any entry past it is read (the array below is exactly
// num_indices long: ASan builds catch a read past it), and the device-side check
// (seq_within_pages) takes such a sequence, or one whose run starts below 0, as unusable.
TEST(PageTable, NumIndicesBoundsIndptr) {
  Table t{{0, 2, 5}, {7, 3, 0, 1}, {5, 16}};
  auto v = t.view();
  EXPECT_TRUE(v.seq_within_pages(1));  // −1: unknown, not checked
  v.num_indices = int(t.indices.size());
  const auto s = kvq::validate_page_table(v, 8);
  EXPECT_EQ(s.code(), StatusCode::out_of_range);
  EXPECT_NE(s.message().find("indptr[2] = 5 exceeds num_indices = 4"), std::string::npos) << s.message();
  EXPECT_TRUE(v.seq_within_pages(0));
  EXPECT_FALSE(v.seq_within_pages(1));
  t.indices.push_back(2);
  v = t.view();
  v.num_indices = int(t.indices.size());
  EXPECT_TRUE(kvq::validate_page_table(v, 8).ok());
  EXPECT_TRUE(v.seq_within_pages(1));
  v.num_indices = -2;
  EXPECT_EQ(kvq::validate_page_table(v, 8).code(), StatusCode::invalid_argument);
  const Table negative{{-2, 1}, {0, 1, 2}, {4}};
  EXPECT_FALSE(negative.view().seq_within_pages(0));
}

}  // namespace
