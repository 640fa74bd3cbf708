"""Operations that span ranks: vocab-parallel log-probs/entropy, counts reduced over DP."""
